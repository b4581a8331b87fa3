"""Hugging Face Llama checkpoints into the recipe's Orbax checkpoints, and back.

    python examples/lm/convert.py from-hf HF_DIR CHECKPOINT_DIR
    python examples/lm/train.py --model-config HF_DIR/config.json \\
        --checkpoint-dir CHECKPOINT_DIR --data tokens.npy ...  # fine-tune from step 0
    python examples/lm/convert.py to-hf CHECKPOINT_DIR OUT_DIR [--step N]

HF_DIR holds config.json and model.safetensors, or shards named by
model.safetensors.index.json (Llama 3.x 1B, 8B, 70B, any shape). from-hf writes step 0
of CHECKPOINT_DIR: the weights in float32, a fresh optimizer (Adam's moments and counts
are zeros) and no data iterator (resilience.py's restore then starts the data at the
checkpoint's step), plus hf_config.json, from which to-hf writes config.json again.
Tokens for --data come from the model's own tokenizer, not train.py's corpus.

The layouts. Hugging Face's Linear stores (out, in) and computes x @ W.T; the recipe's
kernels are (in, out), and its attention weights name their heads: q_proj (N*A, D) ->
query (D, N, A), k_proj and v_proj (K*A, D) -> k and v (D, K, A), o_proj (D, N*A) ->
out (N, A, D). Each layer's tensors are stacked on a leading axis, the scan's.

RoPE needs no permutation. Meta's original checkpoints rotate neighbouring features
(2i, 2i + 1); transformers' rotate_half rotates feature i with i + A/2, so its
conversion script permutes the rows of q and k when it converts Meta's files (`permute`
in transformers/models/llama/convert_llama_weights_to_hf.py). model.rope rotates the
halves too: Hugging Face's q_proj and k_proj go in as they are, which the logits'
parity with transformers checks (tests/test_lm_convert.py).

Memory: the shards are read one tensor at a time, but the step written holds float32
weights and Adam's two moments, and Orbax copies them as it writes: about 18 bytes per
parameter of the host's at the peak (measured: 3.6 GB for 187 M parameters), so 8B
wants a host with some 150 GB.
"""

import argparse
import json
import os
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from safetensors import safe_open
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as model_lib
import model_config
import train

HF_CONFIG = "hf_config.json"  # beside the step folders, which Orbax lists by number
Array = np.ndarray
Config = model_config.ModelConfig


def heads_in(w: Array, c: Config) -> Array:
    """q_proj (N*A, D) -> (D, N, A); k_proj, v_proj (K*A, D) -> (D, K, A)."""
    return w.T.reshape(c.width, -1, c.head_width)


def heads_out(w: Array, c: Config) -> Array:
    """(D, N, A) -> (N*A, D); (D, K, A) -> (K*A, D)."""
    return w.reshape(c.width, -1).T


def out_in(w: Array, c: Config) -> Array:
    """o_proj (D, N*A) -> (N, A, D)."""
    return w.T.reshape(c.num_heads, c.head_width, c.width)


def out_out(w_NAD: Array, c: Config) -> Array:
    return w_NAD.reshape(-1, c.width).T


def transpose(w: Array, c: Config) -> Array:
    """Linear's (out, in) <-> a kernel's (in, out)."""
    return w.T


def same(w: Array, c: Config) -> Array:
    return w


Convert = Callable[[Array, Config], Array]
# model.layers.{i}.NAME.weight -> params["layers"][PATH][i], and the way back
LAYER: dict[str, tuple[tuple[str, ...], Convert, Convert]] = {
    "input_layernorm": (("attention_norm", "scale"), same, same),
    "self_attn.q_proj": (("attention", "query"), heads_in, heads_out),
    "self_attn.k_proj": (("attention", "k"), heads_in, heads_out),
    "self_attn.v_proj": (("attention", "v"), heads_in, heads_out),
    "self_attn.o_proj": (("attention", "out"), out_in, out_out),
    "post_attention_layernorm": (("mlp_norm", "scale"), same, same),
    "mlp.gate_proj": (("mlp", "gate", "kernel"), transpose, transpose),
    "mlp.up_proj": (("mlp", "up", "kernel"), transpose, transpose),
    "mlp.down_proj": (("mlp", "down", "kernel"), transpose, transpose),
}
# Tensors outside the layers; lm_head only if the embeddings are not tied.
TOP: dict[str, tuple[tuple[str, ...], Convert, Convert]] = {
    "model.embed_tokens.weight": (("embed", "embedding"), same, same),
    "model.norm.weight": (("final_norm", "scale"), same, same),
    "lm_head.weight": (("unembed", "kernel"), transpose, transpose),
}
DTYPES = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
}


def layer_name(i: int, name: str) -> str:
    return f"model.layers.{i}.{name}.weight"


def tensor_files(hf_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """Each tensor's file: the index's weight_map if sharded, else model.safetensors."""
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: hf_dir / file for name, file in weight_map.items()}
    with safe_open(hf_dir / "model.safetensors", framework="np") as f:
        return {name: hf_dir / "model.safetensors" for name in f.keys()}  # noqa: SIM118


def expected_names(c: Config) -> list[str]:
    layers = [layer_name(i, n) for i in range(c.num_layers) for n in LAYER]
    top = [n for n in TOP if n != "lm_head.weight" or not c.tie_embeddings]
    return top + layers


def set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def get_path(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def params_from_hf(hf_dir: pathlib.Path, c: Config) -> dict:
    """The recipe's float32 params from the safetensors files, one tensor at a time."""
    files = tensor_files(hf_dir)
    handles = {}

    def read(name: str) -> Array:
        if files[name] not in handles:
            handles[files[name]] = safe_open(files[name], framework="np")
        return handles[files[name]].get_tensor(name).astype(np.float32)

    names = set(files) - {n for n in files if n.endswith("rotary_emb.inv_freq")}
    if c.tie_embeddings and "lm_head.weight" in names:
        # Some tied checkpoints store the table twice; it must be the same table.
        if not np.array_equal(read("lm_head.weight"), read(TOP["lm_head.weight"][0])):
            raise SystemExit(f"{hf_dir}: tie_word_embeddings, but lm_head differs")
        names.discard("lm_head.weight")
    wanted = set(expected_names(c))
    if names != wanted:
        raise SystemExit(
            f"{hf_dir}: missing {sorted(wanted - names)[:4]}, "
            f"unexpected {sorted(names - wanted)[:4]}"
        )
    params: dict = {}
    for name, (path, into, _) in TOP.items():
        if name in wanted:
            set_path(params, path, into(read(name), c))
    for name, (path, into, _) in LAYER.items():
        first = into(read(layer_name(0, name)), c)
        stacked = np.empty((c.num_layers, *first.shape), np.float32)
        for i in range(c.num_layers):
            stacked[i] = into(read(layer_name(i, name)), c)
        set_path(params, ("layers", *path), stacked)
    return params


def params_to_hf(params: dict, c: Config, dtype: np.dtype) -> dict[str, Array]:
    """Hugging Face's tensors (contiguous, as safetensors stores them) from params."""
    tensors = {}
    for name, (path, _, back) in TOP.items():
        if name != "lm_head.weight" or not c.tie_embeddings:
            tensors[name] = back(np.asarray(get_path(params, path)), c)
    for name, (path, _, back) in LAYER.items():
        stacked = np.asarray(get_path(params, ("layers", *path)))
        for i in range(c.num_layers):
            tensors[layer_name(i, name)] = back(stacked[i], c)
    return {n: np.ascontiguousarray(t.astype(dtype)) for n, t in tensors.items()}


def fresh_state(params: dict, model, args):
    """Step 0: ``params`` and train.py's optimizer state before its first update.

    The state's structure comes from step.py's own abstract_state, so its restore
    finds what it expects. Optax's AdamW starts at zeros (its count, its moments), as
    the test checks against tx.init.
    """
    mesh = train.make_mesh("fsdp=-1")  # shapes only: any mesh will do
    with jax.set_mesh(mesh), nn.logical_axis_rules(train.RULES):
        shapes, _ = train.abstract_state(model, train.make_optimizer(args), mesh, 1)
    leaves, name = jax.tree_util.tree_leaves_with_path, jax.tree_util.keystr
    expected = {name(k): (s.shape, s.dtype) for k, s in leaves(shapes.params)}
    for path, p in leaves(params):
        if expected.pop(name(path), None) != (p.shape, p.dtype):
            raise SystemExit(f"params{name(path)} {p.shape} does not fit the model")
    if expected:
        raise SystemExit(f"no tensor for params{next(iter(expected))}")
    zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    return zeros.replace(params=params)


def from_hf(hf_dir: pathlib.Path, checkpoint_dir: pathlib.Path) -> None:
    config_json = hf_dir / "config.json"
    # train.py's defaults for this shape: its optimizer and its checkpoint layout
    args = train.parse_args(
        ["--model-config", str(config_json), "--checkpoint-dir", str(checkpoint_dir)]
    )
    config = train.config_from_args(args)
    params = params_from_hf(hf_dir, config)
    state = fresh_state(params, model_lib.Transformer(config), args)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    manager = train.checkpoint_manager(args)
    if manager.latest_step() is not None:
        raise SystemExit(f"{checkpoint_dir} has step {manager.latest_step()} already")
    manager.save(
        0, args=ocp.args.Composite(state=ocp.args.StandardSave(state)), force=True
    )
    manager.wait_until_finished()
    manager.close()
    (checkpoint_dir / HF_CONFIG).write_text(config_json.read_text())
    print(
        f"{hf_dir} -> {checkpoint_dir} step 0 ({model_config.count_params(config):,})"
    )


def restore_params(checkpoint_dir: pathlib.Path, config: Config, step: int | None):
    """Only the params of the state item, as NumPy arrays: not the optimizer's."""
    manager = ocp.CheckpointManager(
        checkpoint_dir.absolute(),
        item_handlers={"state": ocp.PyTreeCheckpointHandler()},
    )
    step = manager.latest_step() if step is None else step
    if step is None:
        raise SystemExit(f"{checkpoint_dir} has no checkpoint")
    model = model_lib.Transformer(config)
    shapes = jax.eval_shape(
        lambda: model.init(jax.random.key(0), np.zeros((1, 1), np.int32))["params"]
    )
    target = {"params": nn.meta.unbox(shapes)}
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                item=target, restore_args=as_numpy, partial_restore=True
            )
        ),
    )
    manager.close()
    return restored.state["params"], step


def to_hf(
    checkpoint_dir: pathlib.Path,
    out_dir: pathlib.Path,
    step: int | None,
    config_json: str | None,
    preset: str | None,
) -> None:
    if config_json or (checkpoint_dir / HF_CONFIG).exists():
        source = pathlib.Path(config_json or checkpoint_dir / HF_CONFIG)
        hf = json.loads(source.read_text())
        config = model_config.config_from_hf(str(source))
    elif preset:
        config = model_config.PRESETS[preset]
        hf = model_config.config_to_hf(config)
    else:
        raise SystemExit(
            f"{checkpoint_dir} has no {HF_CONFIG}: say --model-config or --model"
        )
    params, step = restore_params(checkpoint_dir, config, step)
    # The config's own type: a bfloat16 Llama comes back bfloat16, exactly (float32
    # holds every bfloat16 value).
    dtype = DTYPES.get(hf.get("dtype") or hf.get("torch_dtype"), np.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        params_to_hf(params, config, dtype),
        out_dir / "model.safetensors",
        metadata={"format": "pt"},
    )
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    print(f"{checkpoint_dir} step {step} -> {out_dir}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    into = commands.add_parser("from-hf", help="Hugging Face -> step 0 of train.py")
    into.add_argument("hf_dir", type=pathlib.Path)
    into.add_argument("checkpoint_dir", type=pathlib.Path)
    back = commands.add_parser("to-hf", help="a step of train.py -> Hugging Face")
    back.add_argument("checkpoint_dir", type=pathlib.Path)
    back.add_argument("hf_dir", type=pathlib.Path)
    back.add_argument("--step", type=int, help="default: the latest")
    back.add_argument("--model-config", help=f"default: the checkpoint's {HF_CONFIG}")
    back.add_argument(
        "--model",
        choices=sorted(model_config.PRESETS),
        help="a preset's checkpoint (train.py --model)",
    )
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.command == "from-hf":
        from_hf(args.hf_dir, args.checkpoint_dir)
    else:
        to_hf(
            args.checkpoint_dir, args.hf_dir, args.step, args.model_config, args.model
        )


if __name__ == "__main__":
    main()
