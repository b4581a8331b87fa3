"""How busy one chip's matrix units get as the model widens: the LM recipe at widths 512 to
4,096 on one device, its measured MFU and HFU.

The planner's compute efficiency per chip (``planning.timing.COMPUTE_EFFICIENCY``) is
fitted to published runs of models 4,096 to 20,480 wide. A narrower model multiplies
narrower matrices, which keep a chip's matrix units less busy. This measures by how much on
the chip at hand: ``jaxdist_lm/train.py`` on ``--mesh data=1``, two layers of each width
(heads of 128, a SwiGLU MLP of 8/3 the width, a 32,768-token vocabulary), sequences of
2,048, four a step, full remat, bfloat16 moments; the median of the steps after the first
three. HFU is the recipe's MFU with the forward that full remat runs again: the blocks',
not the output projection's, which at these widths is a large share of the flops
(``remat_factor``).

It writes ``tpu_widths.json`` into ``--out`` with the date, the chip's ``device_kind`` and
the JAX version; the book reads ``book/data/tpu_widths.json``.

    source .whl-tpu/install.sh && python benchmarks/tpu_widths.py --out $OUT   # the chip
    python benchmarks/tpu_widths.py --show book/data/tpu_widths.json           # its table
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's jaxdist_lm, where it is not installed
sys.path.insert(0, str(ROOT / "benchmarks"))
WIDTHS = (512, 1024, 2048, 4096)
LAYERS, HEAD, VOCAB, SEQ_LEN, BATCH, STEPS = 2, 128, 32_768, 2048, 4, 12


def config(width: int):
    """The recipe's ``ModelConfig`` for two layers of ``width``."""
    from jaxdist_lm import model_config

    heads = width // HEAD
    mlp = round(8 * width / 3 / 128) * 128
    return model_config.ModelConfig(VOCAB, LAYERS, width, heads, heads, mlp)


def shape(width: int) -> dict:
    """A Hugging Face config.json for two layers of ``width`` (``config_to_hf``'s keys)."""
    from jaxdist_lm import model_config

    return model_config.config_to_hf(config(width))


def remat_factor(width: int) -> float:
    """Hardware over model flops under --remat full: the blocks' forward (a third of
    their flops) runs again; the output projection (6 x vocabulary x width a token, no
    remat around it) does not."""
    from jaxdist_lm import model_config

    total = model_config.flops_per_token(config(width), SEQ_LEN)
    blocks = total - 6 * VOCAB * width
    return 1 + blocks / 3 / total


def measure(width: int, workdir: pathlib.Path) -> dict:
    """One run of the recipe at ``width``: its medians, or the line that stopped it."""
    import tpu_report

    path = workdir / f"config-{width}.json"
    path.write_text(json.dumps(shape(width)))
    rows = BATCH * (STEPS + 2)
    data = tpu_report.random_tokens(workdir / "tokens.npy", VOCAB, rows, SEQ_LEN)
    argv = [
        *("--model-config", str(path), "--mesh", "data=1", "--dtype", "bfloat16"),
        *("--seq-len", str(SEQ_LEN), "--global-batch", str(BATCH)),
        *("--remat", "full", "--moments", "bfloat16", "--steps", str(STEPS)),
        *("--data", data, "--compilation-cache", str(workdir / "jax_cache")),
    ]
    print(f"== train.py {' '.join(argv)}", flush=True)
    start = time.perf_counter()
    text, status = tpu_report.captured(argv)
    row = {"width": width, "mlp_width": shape(width)["intermediate_size"]}
    row |= {"status": status, "seconds": round(time.perf_counter() - start, 1)}
    row |= tpu_report.step_summary(text)
    if row.get("mfu"):
        row["hfu"] = row["mfu"] * remat_factor(width)
    return row


def show(report: dict) -> None:
    print(f"{report['device_kind']}, jax {report['jax_version']}, {report['date']}")
    print("| width | MLP | tokens/s | step ms | MFU | HFU |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in report["runs"]:
        if "hfu" not in r:
            print(f"| {r['width']} | {r['mlp_width']} | {r['status']} | | | |")
            continue
        print(
            f"| {r['width']} | {r['mlp_width']} | {r['tokens_per_second']:,.0f} | "
            f"{r['step_seconds'] * 1e3:.0f} | {r['mfu']:.1%} | {r['hfu']:.1%} |"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, help="where tpu_widths.json goes")
    parser.add_argument("--show", type=pathlib.Path, help="print a saved report")
    args = parser.parse_args(argv)
    if args.show:
        show(json.loads(args.show.read_text()))
        return
    if args.out is None:
        parser.error("--out or --show")
    import jax

    if (platform := jax.devices()[0].platform) != "tpu":
        raise SystemExit(f"no TPU here ({platform}): this measures a TPU chip")
    with tempfile.TemporaryDirectory() as tmp:
        runs = [measure(width, pathlib.Path(tmp)) for width in WIDTHS]
    report = {
        "date": datetime.date.today().isoformat(),
        "device_kind": jax.devices()[0].device_kind,
        "jax_version": jax.__version__,
        "shape": {"layers": LAYERS, "head": HEAD, "vocab": VOCAB, "seq_len": SEQ_LEN},
        "batch": BATCH,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tpu_widths.json").write_text(json.dumps(report, indent=1) + "\n")
    show(report)


if __name__ == "__main__":
    main()
