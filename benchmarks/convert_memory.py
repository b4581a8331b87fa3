"""Host memory of jaxdist_lm/convert.py: from-hf and to-hf of made-up Llamas in shards.

Random Llamas (bfloat16; by default width 1,024, MLP 2,816, a 32,000-token vocabulary,
untied, at 12 and 24 layers: 201 M and 336 M parameters) are written as Hugging Face
writes a checkpoint (safetensors shards of at most 50 MB named by
model.safetensors.index.json), converted to the recipe's step 0 (``from-hf``) and back
(``to-hf``, shards of 50 MB), each in a fresh process. The table gives each process's
peak resident memory (``ru_maxrss``) and what it holds above a process that only
imports convert.py (``--help``): a converter that holds the model needs a fixed number
of bytes per parameter, one that streams a peak that stays where it is as the model
grows. ``--to-hf-args ""`` measures a convert.py from before --max-shard-size.

    python benchmarks/convert_memory.py [--layers 12 24] [--width 1024] [--shard-size 50]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The converter, run as a module from ROOT: python -m jaxdist_lm.convert
CONVERT = "jaxdist_lm.convert"
# Runs convert.py as its own __main__, then prints the process's peak resident memory
# (ru_maxrss: KiB on Linux), whether it exited or returned.
MEASURE = """
import resource, runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
finally:
    print("MAXRSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
"""


def llama_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face's Llama tensors and their shapes, in transformers' order."""
    width, mlp, vocab = (
        config[k] for k in ("hidden_size", "intermediate_size", "vocab_size")
    )
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head = width // heads
    shapes = {"model.embed_tokens.weight": (vocab, width)}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        shapes |= {
            prefix + "self_attn.q_proj.weight": (heads * head, width),
            prefix + "self_attn.k_proj.weight": (kv_heads * head, width),
            prefix + "self_attn.v_proj.weight": (kv_heads * head, width),
            prefix + "self_attn.o_proj.weight": (width, heads * head),
            prefix + "mlp.gate_proj.weight": (mlp, width),
            prefix + "mlp.up_proj.weight": (mlp, width),
            prefix + "mlp.down_proj.weight": (width, mlp),
            prefix + "input_layernorm.weight": (width,),
            prefix + "post_attention_layernorm.weight": (width,),
        }
    shapes["model.norm.weight"] = (width,)
    shapes["lm_head.weight"] = (vocab, width)
    return shapes


def write_hf_llama(
    directory: pathlib.Path, shapes: dict[str, tuple[int, ...]], shard_bytes: int
) -> None:
    """Random bfloat16 tensors in shards of at most ``shard_bytes``, with the index;
    one shard in memory at a time."""
    rng = np.random.default_rng(0)
    groups: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)
        if groups[-1] and used + size > shard_bytes:
            groups, used = [*groups, []], 0
        groups[-1].append(name)
        used += size
    weight_map = {}
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {
            name: (0.02 * rng.standard_normal(shapes[name], np.float32)).astype(
                ml_dtypes.bfloat16
            )
            for name in names
        }
        save_file(tensors, directory / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, file)
    total = sum(2 * math.prod(s) for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def peak_memory(argv: list[str]) -> tuple[int, float]:
    """convert.py ``argv`` in a fresh process: its peak resident bytes and seconds."""
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, CONVERT, *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    seconds = time.perf_counter() - start
    lines = [line for line in out.stdout.splitlines() if line.startswith("MAXRSS")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"convert.py {argv[0]} failed:\n{out.stderr[-3000:]}")
    return 1024 * int(lines[-1].split()[1]), seconds


def made_up_config(layers: int, width: int, mlp_width: int, vocab: int) -> dict:
    """config.json of the made-up Llama: heads 64 wide, 4 query heads per KV head."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "num_hidden_layers": layers,
        "hidden_size": width,
        "num_attention_heads": width // 64,
        "num_key_value_heads": width // 256,
        "intermediate_size": mlp_width,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def measure(config: dict, shard_bytes: int, to_hf_args: list[str]) -> dict:
    """from-hf and to-hf of a random Llama of this config: each one's peak and time."""
    shapes = llama_shapes(config)
    with tempfile.TemporaryDirectory() as top:
        hf, checkpoint, back = (pathlib.Path(top) / d for d in ("hf", "ckpt", "back"))
        hf.mkdir()
        (hf / "config.json").write_text(json.dumps(config))
        write_hf_llama(hf, shapes, shard_bytes)
        return {
            "from-hf": peak_memory(["from-hf", str(hf), str(checkpoint)]),
            "to-hf": peak_memory(["to-hf", str(checkpoint), str(back), *to_hf_args]),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--layers", type=int, nargs="+", default=[12, 24], help="one model each"
    )
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--mlp-width", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--shard-size", type=int, default=50, help="MB, the input's")
    parser.add_argument(
        "--to-hf-args",
        default="--max-shard-size 50MB",
        help="more flags for to-hf (empty for a convert.py before --max-shard-size)",
    )
    args = parser.parse_args()
    configs = [
        made_up_config(layers, args.width, args.mlp_width, args.vocab)
        for layers in args.layers
    ]
    versions = {n: importlib.metadata.version(n) for n in ("jax", "orbax-checkpoint")}
    print(
        ", ".join(f"{n} {v}" for n, v in versions.items())
        + f"; width {args.width}, input shards of {args.shard_size} MB; "
        + f"{os.cpu_count()} cores; {datetime.date.today()}"
    )
    imports, _ = peak_memory(["--help"])
    print(f"importing convert.py alone (--help): {imports / 1e6:,.0f} MB")
    print(
        "| parameters | convert.py | peak resident (MB) | above the imports (MB) "
        "| bytes/parameter above | s |"
    )
    print("|---|---|---|---|---|---|")
    for config in configs:
        params = sum(math.prod(s) for s in llama_shapes(config).values())
        rows = measure(config, args.shard_size * 10**6, args.to_hf_args.split())
        for command, (peak, seconds) in rows.items():
            above = peak - imports
            print(
                f"| {params / 1e6:,.0f} M | {command} | {peak / 1e6:,.0f} "
                f"| {above / 1e6:,.0f} | {above / params:.2f} | {seconds:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
