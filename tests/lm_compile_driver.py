"""Compile examples/lm/train.py's step for several meshes in one process; print JSON.

    python tests/lm_compile_driver.py DEVICES MODEL SEQ_LEN GLOBAL_BATCH MESH [MESH ...]

Used by tests/test_lm_recipe.py, so that JAX starts once for all the meshes. For each mesh: the
per-device argument bytes, the collective bytes by kind (train.collective_bytes, loops counted by
their trip counts), and the all-gather bytes split by the mesh axes each one's groups span.
"""

import json
import pathlib
import re
import sys

import jax

jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "lm"))

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import train  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxdist_lessons import hlo  # noqa: E402


def axes_of(groups: list[list[int]], mesh) -> str:
    """Which mesh axes a collective's groups span: 'fsdp', 'tensor', 'fsdp+tensor', ..."""
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    where = {int(d): np.argwhere(ids == d)[0] for d in ids.flat}
    spanned = set()
    for group in groups:
        coords = np.array([where[d] for d in group])
        spanned |= {
            train.AXES[i] for i in range(coords.shape[1]) if len(set(coords[:, i])) > 1
        }
    return "+".join(a for a in train.AXES if a in spanned) or "none"


def all_gathers_by_axes(text: str, mesh) -> dict[str, int]:
    """All-gather bytes by the axes they gather over, with collective_bytes's loop counting:
    the program's text with only one kind of group's all-gathers left in it."""
    lines = text.splitlines()
    kinds = {}
    for number, line in enumerate(lines):
        if re.search(r" all-gather(-start)?\(", line):
            groups = hlo.attribute(line, "replica_groups")
            kinds[number] = axes_of(
                hlo.replica_group_lists(groups, len(mesh.devices.flat)), mesh
            )
    result = {}
    for kind in set(kinds.values()):
        kept = [line.replace(" all-gather", " other-gather") if kinds.get(n, kind) != kind
                else line for n, line in enumerate(lines)]  # fmt: skip
        result[kind] = train.collective_bytes("\n".join(kept)).get("all-gather", 0)
    return result


def main():
    _, _, model_name, seq_len, global_batch, *meshes = sys.argv
    out = {}
    for spec in meshes:
        args = train.parse_args(["--model", model_name, "--mesh", spec, "--seq-len", seq_len,
                                 "--global-batch", global_batch])  # fmt: skip
        mesh = train.make_mesh(args.mesh)
        config = train.model_lib.PRESETS[args.model]
        train.check_fits(config, mesh, args)
        model = train.model_lib.Transformer(config, jnp.float32, args.remat)
        tx = train.make_optimizer(args)
        with jax.set_mesh(mesh), nn.logical_axis_rules(train.RULES):
            shapes, _ = train.abstract_state(model, tx, mesh, args.seq_len)
        step = train.make_train_step(jax.tree.map(lambda s: s.sharding, shapes), mesh)
        tokens = jax.ShapeDtypeStruct((args.global_batch, args.seq_len + 1), jnp.int32,
                                      sharding=NamedSharding(mesh, P(("data", "fsdp"))))  # fmt: skip
        with jax.set_mesh(mesh), nn.logical_axis_rules(train.RULES):
            compiled = step.lower(shapes, tokens).compile()
        text = compiled.as_text()
        out[spec] = {
            "arguments": compiled.memory_analysis().argument_size_in_bytes,
            "collectives": train.collective_bytes(text),
            "all_gathers_by_axes": all_gathers_by_axes(text, mesh),
        }
        print(spec, json.dumps(out[spec]), file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
