"""Hugging Face Llama checkpoints into the recipe's Orbax checkpoints, and back.

    python -m jaxdist_lm.convert from-hf HF_DIR CHECKPOINT_DIR
    python -m jaxdist_lm.train --model-config HF_DIR/config.json \\
        --checkpoint-dir CHECKPOINT_DIR --data tokens.npy ...  # fine-tune from step 0
    python -m jaxdist_lm.convert to-hf CHECKPOINT_DIR OUT_DIR [--step N] \\
        [--max-shard-size 5GB]

HF_DIR holds config.json and model.safetensors, or shards named by
model.safetensors.index.json. from-hf writes step 0: the weights in float32, a fresh
optimizer and no data iterator, plus hf_config.json, from which to-hf writes config.json
again. Tokens for --data come from the model's own tokenizer, not train.py's corpus.

RoPE needs no permutation: transformers' checkpoints already rotate feature i with
i + A/2, as model.rope does (tests/test_lm_convert.py checks the logits' parity).

Neither command holds the model, nor one stacked leaf (75 GB in float32 for each of
70B's MLP kernels): from-hf writes a block at a time, to-hf reads a storage chunk at a
time. Measured peaks (benchmarks/convert_memory.py, 2026-12-06): 640 to 666 MB for
from-hf and 610 to 626 MB for to-hf at 201 M to 336 M parameters, 286 MB of it imports.
"""

import argparse
import dataclasses
import itertools
import json
import math
import pathlib
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from . import model as model_lib
from . import model_config, train
from .hf_tensors import (
    DTYPES,
    INDEX,
    SAFETENSORS_DTYPES,
    Array,
    Config,
    Tensor,
    block_rows,
    check_tensors,
    get_path,
    hf_shape,
    hf_tensors,
    leaf_tensors,
    read_rows,
    tensor_files,
)
from .run_config import RunConfig

# Beside the step folders, which Orbax lists by number.
HF_CONFIG = "hf_config.json"
# --max-shard-size's units, as transformers reads them: kB = 1,000 bytes, KiB = 1,024.
UNITS = {"": 1, "B": 1} | {
    unit: base**power
    for power, prefix in enumerate("KMGT", start=1)
    for unit, base in ((f"{prefix}B", 1000), (f"{prefix}IB", 1024))
}


# Step 0, written by Orbax a block at a time.


@dataclasses.dataclass(frozen=True)
class Blocks:
    """A leaf never whole in memory: ``read(start, stop)`` gives its block [start, stop)
    along ``axis``, when BlockHandler writes that block."""

    shape: tuple[int, ...]
    dtype: np.dtype
    axis: int
    read: Callable[[int, int], Array | float]

    @property
    def rows(self) -> int:
        return block_rows(self.shape, self.axis, self.dtype.itemsize)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


class BlockHandler(ocp.type_handlers.NumpyHandler):
    """Writes Blocks as Orbax writes a NumPy array (restored as one), a block at a time:
    Orbax's own NumpyHandler copies each array and writes it whole."""

    async def serialize(self, values, infos, args=None):
        args = args or [ocp.type_handlers.SaveArgs()] * len(values)
        return [
            ocp.future.CommitFutureAwaitingContractedSignals(
                self._write(values, infos, args), name="blocks"
            )
        ]

    async def _write(self, values: list[Blocks], infos, args) -> None:
        for value, info, arg in zip(values, infos, args, strict=True):
            await info.await_path_creation()
            block = list(value.shape)
            block[value.axis] = value.rows
            ocdbt = info.is_ocdbt_checkpoint
            spec = ocp.type_handlers.get_json_tspec_write(
                info,
                use_ocdbt=ocdbt,
                global_shape=value.shape,
                local_shape=tuple(block),
                dtype=value.dtype,
                process_index=jax.process_index() if ocdbt else None,
                arg=arg,
            )
            array = await ts.open(
                ts.Spec(spec), create=True, open=True, context=info.ts_context
            )
            for start in range(0, value.shape[value.axis], value.rows):
                stop = start + value.rows
                where = (slice(None),) * value.axis + (slice(start, stop),)
                await array[where].write(value.read(start, stop))


def params_from_hf(files: dict, c: Config, params: Any) -> dict:
    """The recipe's params (``params``: their shapes) as Blocks that read the
    safetensors files: a block of layers, or of a top-level tensor's rows."""
    sources = leaf_tensors(c)

    def leaf(path, s: jax.ShapeDtypeStruct) -> Blocks:
        tensors = sources[tuple(k.key for k in path)]
        first = tensors[0]
        if first.layer is None:
            read = lambda i, j: first.into(
                read_rows(files[first.name], first.name, i, j), c
            )
        else:
            read = lambda i, j: np.stack(
                [t.into(read_rows(files[t.name], t.name), c) for t in tensors[i:j]]
            )
        return Blocks(s.shape, np.dtype(s.dtype), first.rows_axis, read)

    return jax.tree_util.tree_map_with_path(leaf, params)


def zero_leaf(s: jax.ShapeDtypeStruct) -> Array | Blocks:
    """A leaf of zeros: Blocks of TensorStore's broadcast 0, a scalar as NumPy's."""
    if not s.shape:
        return np.zeros((), s.dtype)
    return Blocks(s.shape, np.dtype(s.dtype), 0, lambda i, j: 0.0)


def state_shapes(model, run: RunConfig):
    """train.py's state for this model: step.py's own abstract_state, so that its
    restore finds what it expects."""
    # Shapes only: any mesh will do.
    mesh = train.make_mesh("fsdp=-1")
    with jax.set_mesh(mesh), nn.logical_axis_rules(train.RULES):
        shapes, _ = train.abstract_state(model, train.make_optimizer(run), mesh)
    return shapes


def step_zero(hf_dir: pathlib.Path, files: dict, c: Config, run: RunConfig) -> Any:
    """train.py's state at step 0, its params Blocks that read Hugging Face's files,
    AdamW's count and moments zeros (as tx.init's, which the test checks)."""
    shapes = state_shapes(model_lib.abstract(c), run)
    check_tensors(hf_dir, files, c, shapes.params)
    params = params_from_hf(files, c, shapes.params)
    return jax.tree.map(zero_leaf, shapes).replace(params=params)


def block_handler() -> ocp.PyTreeCheckpointHandler:
    """Orbax's handler with its own handlers for the NumPy scalars (and for jax.Array,
    which it looks up), and ours for Blocks, which it must not copy whole."""
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler()),
        (jax.Array, ocp.type_handlers.ArrayHandler()),
        (Blocks, BlockHandler(deepcopy_host_arrays=False)),
    )
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


# No data iterator in step 0: resilience.restore then starts the data at its step.
def from_hf(hf_dir: pathlib.Path, checkpoint_dir: pathlib.Path) -> None:
    config_json = hf_dir / "config.json"
    if not config_json.exists():
        raise SystemExit(f"{hf_dir}: no config.json")
    # train.py's defaults for this shape: its optimizer and its checkpoint layout.
    run = train.parse_args(
        ["--model-config", str(config_json), "--checkpoint-dir", str(checkpoint_dir)]
    )
    config = train.model_config_of(run)
    files = tensor_files(hf_dir)
    with ocp.CheckpointManager(
        checkpoint_dir.absolute(), item_handlers={"state": block_handler()}
    ) as manager:
        if manager.latest_step() is not None:
            raise SystemExit(
                f"{checkpoint_dir} has step {manager.latest_step()} already"
            )
        state = step_zero(hf_dir, files, config, run)
        manager.save(0, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
        manager.wait_until_finished()
    (checkpoint_dir / HF_CONFIG).write_text(config_json.read_text())
    print(
        f"{hf_dir} -> {checkpoint_dir} step 0 ({model_config.count_params(config):,})"
    )


# Back to Hugging Face's files, a storage chunk of the checkpoint at a time.


def open_params(checkpoint_dir: pathlib.Path, step: int | None, c: Config):
    """The step, and each params leaf of its state opened with TensorStore (through
    Orbax's own spec) to be read a chunk at a time; stops if one does not fit."""
    if not checkpoint_dir.is_dir():
        raise SystemExit(f"{checkpoint_dir} has no checkpoint")
    with ocp.CheckpointManager(
        checkpoint_dir.absolute(),
        item_handlers={"state": ocp.PyTreeCheckpointHandler()},
    ) as manager:
        steps = manager.all_steps()
        if not steps:
            raise SystemExit(f"{checkpoint_dir} has no checkpoint")
        step = max(steps) if step is None else step
        if step not in steps:
            having = ", ".join(map(str, steps))
            raise SystemExit(f"{checkpoint_dir} has no step {step}, only {having}")
        metadata = manager.item_metadata(step)["state"]
    wanted = model_lib.params_of(model_lib.abstract(c))
    context = ocp.type_handlers.get_ts_context(use_ocdbt=True)
    leaves = {}
    for path in leaf_tensors(c):
        leaf, want = get_path(metadata.tree["params"], path), get_path(wanted, path)
        if tuple(leaf.shape) != want.shape:
            raise SystemExit(
                f"{checkpoint_dir} step {step}: params.{'.'.join(path)} is "
                f"{tuple(leaf.shape)}, the config's model wants {want.shape}"
            )
        ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(leaf.directory)
        info = ocp.type_handlers.ParamInfo(
            name=leaf.name,
            parent_dir=leaf.directory,
            is_ocdbt_checkpoint=ocdbt,
            use_zarr3=metadata.use_zarr3,
            ts_context=context,
        )
        spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=ocdbt)
        leaves[path] = ts.open(spec, context=context).result()
    return step, leaves


def shard_files(sizes: dict[str, int], max_bytes: int) -> dict[str, list[str]]:
    """Tensors, in order, into files of at most ``max_bytes`` as transformers splits
    them (a larger tensor alone in its own): model.safetensors if one file will do."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_bytes:
            shards, used = [*shards, []], 0
        shards[-1].append(name)
        used += size
    if len(shards) == 1:
        return {"model.safetensors": shards[0]}
    n = len(shards)
    return {f"model-{i:05d}-of-{n:05d}.safetensors": s for i, s in enumerate(shards, 1)}


def create_safetensors(
    file: pathlib.Path, shapes: dict[str, tuple[int, ...]], dtype: np.dtype
) -> dict[str, int]:
    """An empty safetensors file of these tensors, at its full size; each tensor's
    offset in it. Ours, because safetensors' own writer wants every tensor in memory."""
    # The format (github.com/huggingface/safetensors): the header's length (8 bytes,
    # little-endian), the JSON header padded to 8 bytes, the tensors' bytes.
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    end = 0
    for name, shape in shapes.items():
        start, end = end, end + math.prod(shape) * dtype.itemsize
        code = SAFETENSORS_DTYPES[dtype.name]
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [start, end]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(file, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + end)
    return {n: 8 + len(text) + header[n]["data_offsets"][0] for n in shapes}


def chunks(leaf: ts.TensorStore) -> Iterator[tuple[slice, ...]]:
    """The leaf's storage chunks: reading one decodes that chunk alone."""
    step = leaf.chunk_layout.read_chunk.shape
    corners = itertools.product(*(range(0, n, k) for n, k in zip(leaf.shape, step)))
    for corner in corners:
        yield tuple(
            slice(i, min(i + k, n)) for i, k, n in zip(corner, step, leaf.shape)
        )


def pieces(
    tensors: list[Tensor], box: tuple[slice, ...], data: Array
) -> Iterator[tuple[Tensor, tuple[slice, ...], Array]]:
    """A chunk of a leaf (``data``, at ``box``) as its tensors' pieces: each layer's,
    or the top-level tensor's, with where each goes in the tensor's leaf layout."""
    if tensors[0].layer is None:
        yield tensors[0], box, data
        return
    for i in range(box[0].start, box[0].stop):
        yield tensors[i], box[1:], data[i - box[0].start]


def write_chunks(leaves: dict, c: Config, places: dict, shapes: dict, dtype) -> None:
    """Every params leaf into the safetensors files, a storage chunk at a time, each
    piece written in place (``places``: each tensor's file and offset)."""
    # Not a layer at a time: train.py's chunks span every layer (its meshes split
    # widths, heads and the MLP; only 'pipeline' splits the layers), so each chunk
    # would be read and decoded once per layer.
    for path, tensors in leaf_tensors(c).items():
        for box in chunks(leaves[path]):
            data = leaves[path][box].read().result()
            for t, where, piece in pieces(tensors, box, data):
                file, offset = places[t.name]
                hf_array = np.memmap(file, dtype, "r+", offset, shapes[t.name])
                # A view of the file in the leaf's layout (into's reshapes split
                # axes: no copy), written in place and unmapped: its pages leave the
                # process for the page cache, which writes them to disk.
                t.into(hf_array, c)[where] = piece
                del hf_array


def hf_config(
    checkpoint_dir: pathlib.Path, config_json: str | None, preset: str | None
) -> tuple[Config, dict]:
    """The checkpoint's shape, and the config.json to write beside its weights."""
    if config_json or (checkpoint_dir / HF_CONFIG).exists():
        source = pathlib.Path(config_json or checkpoint_dir / HF_CONFIG)
        return model_config.config_from_hf(str(source)), json.loads(source.read_text())
    if preset:
        config = model_config.PRESETS[preset]
        return config, model_config.config_to_hf(config)
    raise SystemExit(
        f"{checkpoint_dir} has no {HF_CONFIG}: say --model-config or --model"
    )


def to_hf(
    checkpoint_dir: pathlib.Path,
    out_dir: pathlib.Path,
    step: int | None,
    config_json: str | None,
    preset: str | None,
    max_shard_size: int,
) -> None:
    config, hf = hf_config(checkpoint_dir, config_json, preset)
    step, leaves = open_params(checkpoint_dir, step, config)
    # The config's own type: a bfloat16 Llama comes back bfloat16, exactly (float32
    # holds every bfloat16 value).
    dtype = np.dtype(DTYPES.get(hf.get("dtype") or hf.get("torch_dtype"), np.float32))
    shapes = {
        t.name: hf_shape(t, leaves[t.path].shape, config) for t in hf_tensors(config)
    }
    sizes = {name: math.prod(shape) * dtype.itemsize for name, shape in shapes.items()}
    files = shard_files(sizes, max_shard_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    # A previous save's weights, which transformers would read beside these.
    old = [*out_dir.glob("model-*-of-*.safetensors"), out_dir / INDEX]
    for path in [*old, out_dir / "model.safetensors"]:
        path.unlink(missing_ok=True)
    places = {}
    for file, names in files.items():
        tensors = {n: shapes[n] for n in names}
        offsets = create_safetensors(out_dir / file, tensors, dtype)
        places |= {n: (out_dir / file, offset) for n, offset in offsets.items()}
    write_chunks(leaves, config, places, shapes, dtype)
    if len(files) > 1:
        count = sum(math.prod(shape) for shape in shapes.values())
        index = {
            "metadata": {"total_parameters": count, "total_size": sum(sizes.values())},
            "weight_map": {n: file for file, names in files.items() for n in names},
        }
        (out_dir / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    print(f"{checkpoint_dir} step {step} -> {out_dir} ({len(files)} safetensors files)")


def shard_size(text: str) -> int:
    """--max-shard-size: bytes, or a number with a unit as transformers spells it."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-zA-Z]*)", text.strip())
    unit = match and UNITS.get(match[2].upper())
    if not unit or float(match[1]) <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a size such as 5GB, 500MB or 2GiB"
        )
    return int(float(match[1]) * unit)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}.convert", description=__doc__.split("\n")[0]
    )
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
    back.add_argument(
        "--max-shard-size",
        type=shard_size,
        default="5GB",
        help="the largest safetensors file, e.g. 5GB, 500MB, 2GiB (default 5GB; "
        "the memory to-hf needs does not depend on it)",
    )
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.command == "from-hf":
        from_hf(args.hf_dir, args.checkpoint_dir)
    else:
        to_hf(
            args.checkpoint_dir,
            args.hf_dir,
            args.step,
            args.model_config,
            args.model,
            args.max_shard_size,
        )


if __name__ == "__main__":
    try:
        main()
    # A refusal: its one line, and status 2 as argparse's.
    except SystemExit as stop:
        if not isinstance(stop.code, str):
            raise
        print(stop.code, file=sys.stderr)
        sys.exit(2)
