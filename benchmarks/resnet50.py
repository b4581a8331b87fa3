"""ResNet50 training throughput (images per second) and model flops utilisation, data parallel.

The step is chapter 05_resnet50's (``train.make_steps``: cross-entropy, SGD with momentum, BatchNorm, donated
state), the batch sharded over every device present, the model computing in bf16 (``--dtype``) with
fp32 parameters. The utilisation is the flops XLA's ``cost_analysis()`` counts for one device's share
of a step, over the step time multiplied by that device's peak for the compute dtype: the bf16 peak
(``hardware.CHIPS``, via ``hardware.peak_flops``, or ``--peak-tflops``) under ``--dtype bfloat16``; under ``--dtype float32``
only ``--peak-tflops`` (give the device's fp32 or TF32 peak), since the table holds bf16 peaks. XLA's
count is of the program, so it includes any recomputation: it is hardware flops utilisation, which
equals model flops utilisation (MFU) here only because this step does no remat.

    python benchmarks/resnet50.py                          # 224x224, width 1: the real thing, for a GPU/TPU
    python benchmarks/resnet50.py --small                  # CPU: 64x64, width 0.25, about a minute
    python benchmarks/resnet50.py --per-device-batch 256 --steps 50
    python benchmarks/resnet50.py --json book/data/resnet50_tpu.json   # also as data, dated
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from jaxdist_lessons import devices


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--small",
        action="store_true",
        help="CPU-sized defaults: --image-size 64 --width 0.25 --per-device-batch 4 --steps 3",
    )
    parser.add_argument("--image-size", type=int, default=None, help="default 224")
    parser.add_argument(
        "--width", type=float, default=None, help="channel multiplier, default 1.0"
    )
    parser.add_argument(
        "--per-device-batch", type=int, default=None, help="default 128"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps, default 20"
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak TFLOP/s of one device for the compute dtype: needed for float32, and for devices"
        " the bf16 table does not know",
    )
    parser.add_argument(
        "--json",
        type=pathlib.Path,
        default=None,
        help="also write the numbers to this file, with the date, device and JAX version",
    )
    args = parser.parse_args(argv)
    small = {"image_size": 64, "width": 0.25, "per_device_batch": 4, "steps": 3}
    full = {"image_size": 224, "width": 1.0, "per_device_batch": 128, "steps": 20}
    for name, value in (small if args.small else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    devices.setup()
    import jax  # after setup(), which must choose the devices first
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import AxisType

    from jaxdist_lessons import benchmark, compiled, hardware, train
    from jaxdist_lessons.models.resnet import ResNet50
    from jaxdist_lessons.tables import Table

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
    model = ResNet50(num_classes=1000, width=args.width, dtype=jnp.dtype(args.dtype))
    tx = optax.sgd(0.1, momentum=0.9)
    image_shape = (args.image_size, args.image_size, 3)
    # No rules: a replicated state.
    state = train.create_train_state(
        model, tx, image_shape, train.rule_shardings(mesh, []), jax.random.key(0)
    )
    shardings = train.shardings_of(state)
    train_step, _ = train.make_steps(shardings, mesh)
    batch_size = args.per_device_batch * n
    rng = np.random.default_rng(0)
    batch = jax.device_put(
        {
            "images": rng.standard_normal((batch_size, *image_shape), dtype=np.float32),
            "labels": rng.integers(0, 1000, batch_size).astype(np.int32),
            "mask": np.ones(batch_size, np.float32),
        },
        jax.sharding.NamedSharding(mesh, jax.P("data")),
    )

    program = train_step.lower(state, batch).compile()
    stats = compiled.stats(program)
    holder = [state]

    def call():
        holder[0], metrics = program(holder[0], batch)
        return metrics["loss"]

    seconds = benchmark.time_per_call(call, calls=args.steps, warmup=2)
    kind = jax.devices()[0].device_kind
    if args.peak_tflops:
        peak = args.peak_tflops * 1e12
    else:  # the table holds bf16 peaks: dividing float32 work by them would understate utilisation
        peak = hardware.peak_flops(kind) if args.dtype == "bfloat16" else None
    rows = [
        ["devices", f"{n} x {kind}"],
        [
            "image size, width, dtype",
            f"{args.image_size}x{args.image_size}, {args.width}, {args.dtype}",
        ],
        ["global batch", batch_size],
        [f"step time (ms, median of {args.steps})", seconds * 1e3],
        ["images per second", batch_size / seconds],
        ["images per second per device", batch_size / seconds / n],
        ["XLA flops per step, per device (recomputation included)", stats.flops],
        ["achieved TFLOP/s per device", stats.flops / seconds / 1e12],
        [
            f"{args.dtype} peak TFLOP/s per device",
            peak / 1e12 if peak else "unknown (pass --peak-tflops)",
        ],
        [
            "flops utilisation (XLA flops / peak; MFU without remat)",
            f"{benchmark.mfu(stats.flops, seconds, peak):.1%}" if peak else "n/a",
        ],
        ["temporaries per device", stats.temp_bytes],
        ["live bytes per device (args + outputs + temps - aliased)", stats.live_bytes],
    ]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {
            **benchmark.provenance(),
            "devices": n,
            "image_size": args.image_size,
            "width": args.width,
            "dtype": args.dtype,
            "global_batch": batch_size,
            "steps": args.steps,
            "step_seconds": seconds,
            "images_per_second": batch_size / seconds,
            "flops_per_step_per_device": stats.flops,
            "peak_flops": peak,
            "mfu": benchmark.mfu(stats.flops, seconds, peak) if peak else None,
            "temp_bytes": stats.temp_bytes,
            "live_bytes": stats.live_bytes,
        }
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(benchmark.environment(), end="\n\n")
    print(Table(["ResNet50 training", "value"], rows, title="ResNet50, data parallel"))


if __name__ == "__main__":
    main(sys.argv[1:])
