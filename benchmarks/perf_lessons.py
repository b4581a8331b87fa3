"""Chapter 6's lessons on one device: precision, remat, donation, accumulation, attention.

Chapter 6 teaches them on simulated CPU devices, where XLA:CPU's memory figures hide part of
what they do. This script measures them on whatever device JAX finds first (a TPU chip, a GPU,
or one CPU device), on chapter 6's decoder (``jaxdist_lessons.models.transformer.Decoder``):

- one training step (gradient and Adam update) per variant of ``VARIANTS``, each changing one
  thing from the baseline (float32, no remat, donated state, one micro-batch): its compiled
  memory (arguments, outputs, temporaries, aliased and live bytes), XLA's flops, the median
  step time and tokens per second, and on a chip of ``hardware.CHIPS`` its model flops
  utilisation (the baseline's flops, whatever the variant recomputes) against the chip's
  dense bfloat16 peak;
- the LM recipe's attentions (``benchmarks/splash_check.py``'s: XLA's, the chunked blocks and,
  on a TPU only, splash) forward and backward at two sequence lengths: temporaries and time.

``SIZES`` holds two shapes: ``small`` runs in seconds on a laptop's CPU, ``chip`` is sized for
one 16 GB accelerator. The same ``small`` on both sides is what the chapter compares.

    python benchmarks/perf_lessons.py --out book/data/perf_lessons_cpu.json        # XLA:CPU
    source .whl-tpu/install.sh && python benchmarks/perf_lessons.py --sizes small,chip \\
        --out $OUT/perf_lessons_tpu.json                                           # a chip
    python benchmarks/perf_lessons.py --show book/data/perf_lessons_tpu.json        # its tables
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

# Each variant: (lesson, name, what it changes from the baseline). "policy" is a name of
# residuals.REMAT_POLICIES; "dtype" a name of residuals.PRECISIONS.
VARIANTS: list[tuple[str, str, dict]] = [
    ("baseline", "float32, no remat, donated, 1 micro-batch", {}),
    ("precision", "bf16 compute, fp32 params", {"dtype": "bf16 compute, fp32 params"}),
    ("precision", "bf16 everything", {"dtype": "bf16 everything"}),
    (
        "remat",
        "dots_with_no_batch_dims_saveable",
        {"policy": "dots_with_no_batch_dims_saveable"},
    ),
    ("remat", "full", {"policy": "full (save only block inputs)"}),
    ("donation", "not donated", {"donate": False}),
    ("accumulation", "4 micro-batches", {"micro": 4}),
    # The first program a process runs is timed slow on a TPU (2x on a v5e): the
    # baseline again, last, is the one the others are compared with.
    ("baseline", "the baseline again, measured last", {}),
]


@dataclasses.dataclass(frozen=True)
class Size:
    """The decoder's shape and one step's batch (sequences of ``seq_len`` tokens)."""

    num_layers: int
    hidden: int
    num_heads: int
    vocab_size: int
    seq_len: int
    batch: int
    attention_lengths: tuple[int, ...]


SIZES = {
    "tiny": Size(1, 32, 2, 64, 16, 4, (128,)),  # tests only
    "small": Size(4, 256, 4, 4096, 256, 8, (256, 1024)),
    "chip": Size(8, 1024, 8, 32768, 1024, 8, (2048, 8192)),
}


def step_program(decoder, tx, micro: int, donate: bool):
    """A jitted ``(params, opt_state, tokens) -> (params, opt_state, loss)``: the
    gradient summed over ``micro`` micro-batches in a ``lax.scan``, then Adam's update."""
    import jax
    import optax
    from jax.sharding import AxisType

    from jaxdist_lessons import accumulate
    from jaxdist_lessons.models import transformer

    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,))
    loss = lambda params, tokens: transformer.next_token_loss(decoder, params, tokens)
    grads_fn = accumulate.naive_grads(loss, mesh, micro)

    def step(params, opt_state, tokens):
        value, grads = grads_fn(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())


def measure_step(size: Size, change: dict, calls: int) -> dict:
    """One variant's compiled memory, flops and median step time."""
    import jax
    import optax

    from jaxdist_lessons import benchmark, compiled, precision, residuals
    from jaxdist_lessons.models import transformer

    dtype, param_dtype = residuals.PRECISIONS[change.get("dtype", "fp32")]
    policy = residuals.REMAT_POLICIES[change["policy"]] if "policy" in change else None
    decoder = transformer.Decoder(
        vocab_size=size.vocab_size,
        num_layers=size.num_layers,
        hidden=size.hidden,
        num_heads=size.num_heads,
        max_len=size.seq_len,
        dtype=dtype,
        param_dtype=param_dtype,
        remat_policy=policy,
    )
    tokens = transformer.random_tokens(
        jax.random.key(1), size.batch, size.seq_len + 1, size.vocab_size
    )
    params = jax.jit(decoder.init)(jax.random.key(0), tokens[:1, :-1])["params"]
    params = precision.Policy(param_dtype=param_dtype).to_param(params)
    tx = optax.adam(1e-4)
    opt_state = tx.init(params)
    program = step_program(
        decoder, tx, change.get("micro", 1), change.get("donate", True)
    )
    start = time.perf_counter()
    executable = program.lower(params, opt_state, tokens).compile()
    compile_seconds = time.perf_counter() - start
    stats = compiled.stats(executable)
    state = [params, opt_state]

    def call():
        state[0], state[1], loss = executable(state[0], state[1], tokens)
        return loss

    seconds = benchmark.time_per_call(call, calls=calls, warmup=2)
    loss = float(call())
    return {
        "parameters": sum(leaf.size for leaf in jax.tree.leaves(params)),
        "flops": stats.flops,
        "argument_bytes": stats.argument_bytes,
        "output_bytes": stats.output_bytes,
        "temp_bytes": stats.temp_bytes,
        "alias_bytes": stats.alias_bytes,
        "live_bytes": stats.live_bytes,
        "compile_seconds": round(compile_seconds, 2),
        "step_seconds": seconds,
        "tokens_per_second": size.batch * size.seq_len / seconds,
        "loss": loss,
    }


def measure_attention(length: int, calls: int) -> list[dict]:
    """The recipe's attentions forward and backward on one device at ``length``
    (splash_check's shape: the 125m preset's heads): temporaries and median seconds."""
    import jax
    import jax.numpy as jnp
    import splash_check

    from jaxdist_lessons import compiled

    arrays, starts_BT = splash_check.inputs(length, jnp.bfloat16)
    rows = []
    for kind, attend in splash_check.attentions(length).items():
        row = {"kind": kind, "length": length, "dtype": "bfloat16"}
        if kind == "splash" and jax.default_backend() != "tpu":
            rows.append({**row, "status": "TPU only (interpreted elsewhere)"})
            continue
        run = splash_check.forward_and_backward(attend, starts_BT)
        executable = run.lower(*arrays).compile()
        jax.block_until_ready(executable(*arrays))
        seconds = splash_check.median_seconds(executable, arrays, calls)
        stats = compiled.stats(executable)
        rows.append(
            {**row, "status": "ran", "temp_bytes": stats.temp_bytes, "seconds": seconds}
        )
    return rows


def measure(size_name: str, calls: int) -> dict:
    """Every variant and attention at one of ``SIZES``."""
    import jax

    from jaxdist_lessons import benchmark, hardware

    size = SIZES[size_name]
    peak = hardware.peak_flops(jax.devices()[0].device_kind)
    rows = []
    for lesson, name, change in VARIANTS:
        row = {"lesson": lesson, "variant": name, **measure_step(size, change, calls)}
        # Model flops: the baseline's count (XLA counts remat's recomputation, and a
        # scan's body once), over the chip's dense bfloat16 peak.
        model_flops = (rows[0] if rows else row)["flops"]
        row["mfu"] = (
            benchmark.mfu(model_flops, row["step_seconds"], peak) if peak else None
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
    attention = [
        row
        for length in size.attention_lengths
        for row in measure_attention(length, calls)
    ]
    for row in attention:
        print(json.dumps(row), flush=True)
    return {"shape": dataclasses.asdict(size), "steps": rows, "attention": attention}


def table(report: dict, size_name: str) -> str:
    """One size's steps and attentions as Markdown, each against the baseline."""
    part = report["sizes"][size_name]
    # The baseline measured last where there is one ("the baseline again"): a process's
    # first program is timed slow. Older files, and runs cut short, have only the first.
    base = [row for row in part["steps"] if row["lesson"] == "baseline"][-1]
    lines = [
        f"{size_name}: {part['shape']}",
        *([part["note"]] if "note" in part else []),
        "",
        "| lesson | variant | temp MB | live MB | temp / base | step ms | step / base | MFU |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in part["steps"]:
        mfu = "" if row["mfu"] is None else f"{row['mfu']:.1%}"
        lines.append(
            f"| {row['lesson']} | {row['variant']} | {row['temp_bytes'] / 1e6:,.1f} "
            f"| {row['live_bytes'] / 1e6:,.1f} | {row['temp_bytes'] / base['temp_bytes']:.2f} "
            f"| {row['step_seconds'] * 1e3:,.2f} "
            f"| {row['step_seconds'] / base['step_seconds']:.2f} | {mfu} |"
        )
    lines += ["", "| attention | length | temp MB | ms |", "|---|---:|---:|---:|"]
    for row in part["attention"]:
        if row["status"] != "ran":
            lines.append(f"| {row['kind']} | {row['length']} | {row['status']} | |")
            continue
        lines.append(
            f"| {row['kind']} | {row['length']} | {row['temp_bytes'] / 1e6:,.1f} "
            f"| {row['seconds'] * 1e3:,.2f} |"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, help="the JSON file to write")
    parser.add_argument(
        "--sizes", default="small", help=f"comma-separated, of {', '.join(SIZES)}"
    )
    parser.add_argument("--calls", type=int, default=10, help="timed calls a variant")
    parser.add_argument("--show", type=pathlib.Path, help="print a file's tables, stop")
    args = parser.parse_args(argv)
    unknown = set(args.sizes.split(",")) - set(SIZES)
    if unknown:
        parser.error(f"unknown size {sorted(unknown)}; known: {', '.join(SIZES)}")
    if args.show is None and args.out is None:
        parser.error("give --out FILE (or --show FILE)")
    return args


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.show:
        report = json.loads(args.show.read_text())
        print(f"{report['device_kind']}, jax {report['jax_version']}, {report['date']}")
        for name in report["sizes"]:
            print("\n" + table(report, name))
        return None
    from jaxdist_lessons import benchmark

    report = {
        **benchmark.provenance(),
        "how": "python benchmarks/perf_lessons.py, one device, "
        f"median of {args.calls} calls after 2 warm-up calls",
        "sizes": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.sizes.split(","):
        report["sizes"][name] = measure(name, args.calls)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print("\n" + table(report, name), flush=True)
    return report


if __name__ == "__main__":
    main()
