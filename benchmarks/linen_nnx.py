"""Linen or NNX for the LM recipe's layers: one block, compiled and timed in both APIs.

The recipe's ``Block`` (``jaxdist_lm/model.py``) is Flax NNX;
``jaxdist_lessons/models/linen_block.py`` writes it in Flax Linen, as the recipe was
written before: the same weights under the same paths and logical names, the recipe's
own functions for the arithmetic. This builds both for one preset's width and takes the
same step with each, the gradient of a squared loss on the block's output with respect
to its weights, in bfloat16 compute over float32 weights:

- compiled on a ``data=2,fsdp=2,tensor=2`` mesh of 8 devices, the weights laid out by the
  recipe's rules: the bytes of each collective kind, the arguments and temporaries a
  device holds, and how many instructions of each kind the optimised program has;
- timed on one device: the median of ``--steps`` steps of each, after two that compile
  and warm up.

It writes ``linen_nnx_<platform>_<preset>.json`` into ``--out``, with the date, the device's
``device_kind`` and the JAX and Flax versions; the book reads ``book/data/linen_nnx_*.json``.

    python benchmarks/linen_nnx.py --out book/data --steps 0          # 8 CPU devices
    python benchmarks/linen_nnx.py --out $OUT --preset 1b --batch 4 --seq-len 2048  # chip
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import pathlib
import re
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MESH = {"data": 2, "fsdp": 2, "tensor": 2}
# An optimised program's instruction: "%name = type opcode(" (async pairs by their start).
OPCODE = re.compile(r"^\s*(?:ROOT )?%?[\w.-]+ = .+? ([a-z][a-z0-9-]*)\(", re.M)


def blocks(preset: str, batch: int, seq_len: int):
    """The recipe's NNX block with its weights, the Linen block, its variables (the NNX
    block's weights, the paths being the same), and an input of ``batch`` x
    ``seq_len`` in bfloat16."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxdist_lessons.models import linen_block
    from jaxdist_lm import model, model_config

    config = model_config.PRESETS[preset]
    x_BTD = jax.random.normal(jax.random.key(0), (batch, seq_len, config.width))
    x_BTD = x_BTD.astype(jnp.bfloat16)
    positions_T = jnp.arange(seq_len)
    block = model.Block(config, jnp.bfloat16, rngs=nnx.Rngs(1))
    linen = linen_block.LinenBlock(config, jnp.bfloat16)
    variables = {"params": nnx.to_pure_dict(nnx.state(block, nnx.Param))}
    return linen, variables, block, x_BTD, positions_T


def steps(linen, variables, block, positions_T):
    """Each API's step, ``(weights, x) -> gradients``, its weights, and their logical
    names (``PartitionSpec``s of the recipe's logical axes)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from flax import nnx

    def square(y_BTD):
        return jnp.mean(jnp.square(y_BTD.astype(jnp.float32)))

    def linen_loss(params, x_BTD):
        return square(linen.apply({"params": params}, x_BTD, positions_T))

    graph, state = nnx.split(block)

    def nnx_loss(state, x_BTD):
        # (output, the experts' loss: 0 for a dense block)
        y_BTD, _ = nnx.merge(graph, state)(x_BTD, positions_T, None)
        return square(y_BTD)

    # Linen's names are in the boxes init makes: traced for them, nothing drawn.
    x_BTD = jnp.zeros((1, positions_T.shape[0], linen.config.width))
    boxed = jax.eval_shape(linen.init, jax.random.key(0), x_BTD, positions_T)
    return {
        "linen": (
            jax.grad(linen_loss),
            variables["params"],
            nn.get_partition_spec(boxed)["params"],
        ),
        "nnx": (jax.grad(nnx_loss), state, nnx.get_partition_spec(state)),
    }


def opcodes(hlo_text: str) -> dict[str, int]:
    """How many instructions of each kind an optimised HLO program has."""
    return dict(sorted(collections.Counter(OPCODE.findall(hlo_text)).items()))


def compiled(preset: str, batch: int, seq_len: int) -> dict[str, dict]:
    """Both steps compiled on ``MESH``, the weights laid out by the recipe's rules."""
    import flax.linen as nn
    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdist_lessons import comms
    from jaxdist_lessons import compiled as compiled_stats
    from jaxdist_lm import layout

    mesh = jax.make_mesh(
        tuple(MESH.get(a, 1) for a in layout.AXES),
        layout.AXES,
        axis_types=(AxisType.Auto,) * len(layout.AXES),
        devices=jax.devices()[:8],
    )
    linen, variables, block, x_BTD, positions_T = blocks(preset, batch, seq_len)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    # Linen's names traced outside the mesh: under it, init would constrain them.
    both = steps(linen, variables, block, positions_T)
    out = {}
    with jax.set_mesh(mesh), nn.logical_axis_rules(layout.RULES):
        for api, (step, weights, names) in both.items():
            placed = nn.logical_to_mesh_sharding(names, mesh, layout.RULES)
            program = (
                jax.jit(step, in_shardings=(placed, rows), out_shardings=placed)
                .lower(weights, x_BTD)
                .compile()
            )
            text, stats = program.as_text(), compiled_stats.stats(program)
            out[api] = {
                "arguments": stats.argument_bytes,
                "temporaries": stats.temp_bytes,
                "collectives": comms.bytes_by_kind(text),
                "instructions": opcodes(text),
            }
    return out


def timed(preset: str, batch: int, seq_len: int, count: int) -> dict[str, float]:
    """Median seconds of ``count`` steps of each API on one device."""
    import jax

    linen, variables, block, x_BTD, positions_T = blocks(preset, batch, seq_len)
    out = {}
    for api, (step, weights, _) in steps(linen, variables, block, positions_T).items():
        run = jax.jit(step)
        for _ in range(2):  # compile, then warm up
            jax.block_until_ready(run(weights, x_BTD))
        seconds = []
        for _ in range(count):
            start = time.perf_counter()
            jax.block_until_ready(run(weights, x_BTD))
            seconds.append(time.perf_counter() - start)
        out[api] = statistics.median(seconds)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="a folder for the JSON")
    parser.add_argument("--preset", default="125m", help="the recipe's preset's block")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="timed steps; 0: none")
    args = parser.parse_args()

    from jaxdist_lessons import devices

    devices.setup(min_devices=1)
    import flax
    import jax

    shape = (args.preset, args.batch, args.seq_len)
    record = {
        "meta": {
            "date": str(datetime.date.today()),
            "platform": jax.default_backend(),
            "device_kind": jax.devices()[0].device_kind,
            "jax_version": jax.__version__,
            "flax_version": flax.__version__,
            "preset": args.preset,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "command": "python benchmarks/linen_nnx.py " + " ".join(sys.argv[1:]),
        },
    }
    if args.steps:
        record["seconds"] = timed(*shape, args.steps)
    if jax.device_count() >= 8:
        record["compiled"] = compiled(*shape)
        mesh = ",".join(f"{axis}={size}" for axis, size in MESH.items())
        record["meta"].update(mesh=mesh, devices=jax.device_count())
    name = f"linen_nnx_{jax.default_backend()}_{args.preset}.json"
    path = pathlib.Path(args.out) / name
    path.write_text(json.dumps(record, indent=1) + "\n")
    if "seconds" in record:
        print(f"{record['meta']['device_kind']}: step seconds {record['seconds']}")
    for api, program in record.get("compiled", {}).items():
        kinds = sum(program["instructions"].values())
        print(
            f"{api}: arguments {program['arguments']:,} B, temporaries "
            f"{program['temporaries']:,} B, collectives {program['collectives']}, "
            f"{kinds} instructions"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
