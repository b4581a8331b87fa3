"""Hugging Face's Llama tensors: their names, their places in the recipe's params and
the conversions between the two layouts, and their safetensors files, read a block of
rows at a time. convert.py writes checkpoints from them and back.
"""

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np
from safetensors import safe_open

from . import model_config

INDEX = "model.safetensors.index.json"
# The most bytes of a leaf read, converted and written at once, unless one row (one
# layer, for a layer's tensor) is larger.
BLOCK_BYTES = 64 * 2**20
Array = np.ndarray
Config = model_config.ModelConfig


# Hugging Face's Linear stores (out, in) and computes x @ W.T; the recipe's kernels are
# (in, out), and its attention weights name their heads.
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
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One of Hugging Face's tensors and its place in the recipe's params."""

    name: str
    # Its params leaf, and its index on the leaf's leading (scan) axis: None for a
    # top-level tensor.
    path: tuple[str, ...]
    layer: int | None
    into: Convert
    back: Convert

    @property
    def rows_axis(self) -> int:
        """The leaf's axis along which this tensor's rows run (a layer's: layers)."""
        return 1 if self.layer is None and self.into is transpose else 0


def layer_name(i: int, name: str) -> str:
    return f"model.layers.{i}.{name}.weight"


def hf_tensors(c: Config) -> list[Tensor]:
    """Hugging Face's tensors in transformers' order: embeddings, layers, norm, head."""
    embed, norm, head = (
        Tensor(name, path, None, into, back) for name, (path, into, back) in TOP.items()
    )
    layers = [
        Tensor(layer_name(i, name), ("layers", *path), i, into, back)
        for i in range(c.num_layers)
        for name, (path, into, back) in LAYER.items()
    ]
    return [embed, *layers, norm] + ([] if c.tie_embeddings else [head])


def leaf_tensors(c: Config) -> dict[tuple[str, ...], list[Tensor]]:
    """Each params leaf's tensors: a layer leaf's in layer order, a top-level one's."""
    leaves: dict[tuple[str, ...], list[Tensor]] = {}
    for t in hf_tensors(c):
        leaves.setdefault(t.path, []).append(t)
    return leaves


def hf_shape(t: Tensor, leaf_shape: tuple[int, ...], c: Config) -> tuple[int, ...]:
    """The tensor's shape in Hugging Face's files, from its params leaf's."""
    shape = leaf_shape if t.layer is None else leaf_shape[1:]
    leaf = jax.ShapeDtypeStruct(shape, np.float32)
    return jax.eval_shape(lambda w: t.back(w, c), leaf).shape


def block_rows(shape: tuple[int, ...], axis: int, itemsize: int) -> int:
    """Rows per block along ``axis``: the most within BLOCK_BYTES that divide its size
    (every block whole, one storage chunk each), or one."""
    row_bytes = itemsize * math.prod(shape) // shape[axis]
    fits = min(max(1, BLOCK_BYTES // row_bytes), shape[axis])
    return max(d for d in range(1, fits + 1) if shape[axis] % d == 0)


def get_path(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


# Hugging Face's files, read a tensor (or a block of its rows) at a time.


def tensor_files(hf_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """Each tensor's file: the index's weight_map if sharded, else model.safetensors."""
    index, single = hf_dir / INDEX, hf_dir / "model.safetensors"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: hf_dir / file for name, file in weight_map.items()}
    if not single.exists():
        raise SystemExit(f"{hf_dir}: no model.safetensors and no {INDEX}")
    with safe_open(single, framework="np") as f:
        return dict.fromkeys(f.keys(), single)


def file_shapes(files: dict[str, pathlib.Path]) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, from the files' headers alone."""
    shapes = {}
    for file in sorted(set(files.values())):
        with safe_open(file, framework="np") as f:
            shapes |= {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118
    return shapes


def read_rows(
    file: pathlib.Path, name: str, start: int | None = None, stop: int | None = None
) -> Array:
    """Rows [start, stop) of one tensor, as float32."""
    # The file is mapped only while it is read: its pages leave the process with it.
    with safe_open(file, framework="np") as f:
        return f.get_slice(name)[start:stop].astype(np.float32)


def same_table(
    files: dict[str, pathlib.Path], a: str, b: str, shape: tuple[int, ...]
) -> bool:
    """Whether tensors a and b (both ``shape``) are equal, a block of rows at a time."""
    rows = block_rows(shape, 0, 4)
    return all(
        np.array_equal(
            read_rows(files[a], a, i, i + rows), read_rows(files[b], b, i, i + rows)
        )
        for i in range(0, shape[0], rows)
    )


def check_tensors(hf_dir: pathlib.Path, files: dict, c: Config, params: Any) -> None:
    """Stops, in one line, at a tensor missing, unexpected, or not of the shape that
    config.json's model (``params``: its leaves' shapes) wants."""
    shapes = file_shapes(files)
    names = {n for n in files if not n.endswith("rotary_emb.inv_freq")}
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    if c.tie_embeddings and head in names:
        # Some tied checkpoints store the table twice; it must be the same table.
        if shapes[head] != shapes[embed] or not same_table(
            files, head, embed, shapes[head]
        ):
            raise SystemExit(f"{hf_dir}: tie_word_embeddings, but lm_head differs")
        names.discard(head)
    tensors = hf_tensors(c)
    wanted = {t.name for t in tensors}
    if names != wanted:
        raise SystemExit(
            f"{hf_dir}: missing {sorted(wanted - names)[:4]}, "
            f"unexpected {sorted(names - wanted)[:4]}"
        )
    for t in tensors:
        want = hf_shape(t, get_path(params, t.path).shape, c)
        if shapes.get(t.name) != want:
            raise SystemExit(
                f"{hf_dir}: {t.name} is {shapes.get(t.name)}, "
                f"config.json's model wants {want}"
            )
