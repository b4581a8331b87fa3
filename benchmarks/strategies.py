"""Data parallelism, ZeRO-1 and FSDP on an MLP and a small Transformer: one table per strategy.

Each table gives the collective bytes read from the compiled program against what theory expects,
the parameters and optimizer state each device holds, its temporaries and live bytes (arguments +
outputs + temporaries - aliased), the step time and the throughput. Runs on whatever devices ``devices.setup`` finds: simulated CPU devices on a
laptop, or the GPUs / TPUs of the machine.

    python benchmarks/strategies.py                       # 8 simulated CPU devices, or the accelerators
    JAXDIST_NUM_DEVICES=4 python benchmarks/strategies.py
    python benchmarks/strategies.py --model transformer --hidden 512 --layers 8 --calls 20
"""

from __future__ import annotations

import argparse

# Importing zero creates no arrays: devices.setup() still comes first.
from jaxdist_lessons import devices, zero


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", choices=["mlp", "transformer", "both"], default="both"
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        choices=zero.ZERO_STAGES,
        default=list(zero.ZERO_STAGES),
    )
    parser.add_argument("--width", type=int, default=256, help="MLP hidden width")
    parser.add_argument(
        "--hidden", type=int, default=64, help="Transformer hidden size"
    )
    parser.add_argument("--layers", type=int, default=2, help="Transformer blocks")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument(
        "--per-device-batch",
        type=int,
        default=None,
        help="examples per device (default: 32 for the MLP, 4 for the Transformer)",
    )
    parser.add_argument(
        "--calls",
        type=int,
        default=5,
        help="timed steps per strategy (median reported)",
    )
    args = parser.parse_args()

    devices.setup()
    import jax  # after setup(), which must choose the devices first
    from jax.sharding import AxisType

    from jaxdist_lessons import benchmark

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
    workloads = []
    if args.model in ("mlp", "both"):
        workloads.append(
            benchmark.mlp_workload(
                n, width=args.width, per_device_batch=args.per_device_batch or 32
            )
        )
    if args.model in ("transformer", "both"):
        workloads.append(
            benchmark.transformer_workload(
                n,
                num_layers=args.layers,
                hidden=args.hidden,
                seq_len=args.seq_len,
                per_device_batch=args.per_device_batch or 4,
            )
        )
    print(benchmark.environment(), end="\n\n")
    for work in workloads:
        for strategy in args.strategies:
            print(
                benchmark.strategy_table(strategy, work, mesh, calls=args.calls),
                end="\n\n",
            )


if __name__ == "__main__":
    main()
