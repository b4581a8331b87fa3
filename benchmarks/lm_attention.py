"""Memory per device of the LM recipe's step at long sequences: is attention linear?

Compiles (no arrays allocated) one training step of ``python -m jaxdist_lm.train
--compile-only`` at the 8b preset on 8 simulated CPU devices with ``--mesh sequence=8``
(ring attention: each device holds 1/8 of the tokens, and each ring step attends in
chunked blocks), bf16 compute, one sequence per step, at several sequence lengths, and
prints the temporaries per device, their ratio to the previous length's and the
difference. Attention that formed each ring step's T/8 x T/8 scores would add 4x its
memory when T doubles; blocks add 2x, as the rest of the step (activations, logits)
does. On sequence=8 the weights are whole on every device: their gradients and Adam's
update (about 50 GB) are most of the temporaries, the same at any length, so the
difference is what the sequence costs.

Measured (2 cores, XLA:CPU): chunked 50.105 GB at 16384, 53.685 GB at 32768 (1.07x,
+3.6 GB); the ring attention before chunked blocks (``--recipe`` on a copy of it, with
``--attentions none``: it has no --attention flag) 70.599 and 137.228 GB (1.94x, +66.6
GB). --attention xla gives chunked's numbers here: with a 'sequence' axis the model
takes ring attention, whatever the flag.

XLA:CPU compiles the 32 layers' scan body once, so the layer count changes the
temporaries little (memory per layer is what grows with T); ``--layers`` compiles fewer
of them (the 8b's shapes otherwise), which is faster on a small CPU.

    python benchmarks/lm_attention.py                      # 8b, T = 16384 and 32768
    python benchmarks/lm_attention.py --layers 2 --seq-lens 8192 16384 32768
    python benchmarks/lm_attention.py --recipe /tmp/old/jaxdist_lm   # another copy
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import recipe_copy

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEVICES = 8


def compile_one(
    recipe: str, model: str, layers: int | None, seq_len: int, attention: str | None
) -> dict:
    """In this process (a fresh one, with 8 CPU devices): compile one step, return the
    temporaries, the arguments and the seconds the compile took, of the recipe's copy at
    ``recipe`` (``recipe_copy.locate`` says where it is imported from)."""
    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES)
    where, prefix = recipe_copy.locate(recipe)
    sys.path.insert(0, str(where))
    model_config = importlib.import_module(prefix + "model_config")
    train = importlib.import_module(prefix + "train")

    if layers:
        preset = model_config.PRESETS[model]
        model_config.PRESETS[model] = dataclasses.replace(preset, num_layers=layers)
    argv = [
        "--model",
        model,
        "--mesh",
        "sequence=8",
        "--seq-len",
        str(seq_len),
        "--global-batch",
        "1",
        "--dtype",
        "bfloat16",
        "--compile-only",
        "--compilation-cache",
        tempfile.mkdtemp(),
    ]
    if attention:  # an older recipe has no --attention
        argv += ["--attention", attention]
    printed, start = io.StringIO(), time.perf_counter()
    with contextlib.redirect_stdout(printed):
        train.main(argv)
    seconds = time.perf_counter() - start
    line = next(
        x for x in printed.getvalue().splitlines() if x.startswith("per device")
    )
    gb = dict(re.findall(r"(arguments|temporaries) ([\d.]+) GB", line))
    return {"seconds": seconds, **{k: float(v) for k, v in gb.items()}}


def run(recipe, model, layers, seq_len, attention) -> dict:
    """compile_one in a fresh process (JAX's device count is set once a process)."""
    command = [
        sys.executable,
        __file__,
        "--one",
        json.dumps([recipe, model, layers, seq_len, attention]),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{seq_len} {attention} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="8b")
    parser.add_argument("--layers", type=int, help="fewer layers than the preset's")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--attentions", nargs="+", default=["chunked"])
    parser.add_argument(
        "--recipe",
        default=str(ROOT / "jaxdist_lm"),
        help="the recipe's folder (a copy of jaxdist_lm/, or an older examples/lm/)",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return print(json.dumps(compile_one(*json.loads(args.one))))
    versions = ", ".join(
        f"{name} {importlib.metadata.version(name)}" for name in ("jax", "flax")
    )
    print(
        f"{args.model} ({args.layers or 'all'} layers), --mesh sequence=8 on "
        f"{DEVICES} simulated CPU devices, bf16, 1 sequence; {versions}; "
        f"{os.cpu_count()} cores, {datetime.date.today()}"
    )
    print(
        f"{'attention':>9} {'seq':>6} {'temps GB':>9} {'args GB':>8} "
        f"{'x previous':>10} {'+ GB':>7} {'compile s':>9}"
    )
    for attention in args.attentions:
        previous = None
        for seq_len in args.seq_lens:
            row = run(
                args.recipe,
                args.model,
                args.layers,
                seq_len,
                None if attention == "none" else attention,
            )
            ratio = row["temporaries"] / previous if previous else float("nan")
            more = row["temporaries"] - previous if previous else float("nan")
            print(
                f"{attention:>9} {seq_len:>6} {row['temporaries']:>9.3f} "
                f"{row['arguments']:>8.3f} {ratio:>10.2f} {more:>7.3f} "
                f"{row['seconds']:>9.1f}",
                flush=True,
            )
            previous = row["temporaries"]


if __name__ == "__main__":
    main()
