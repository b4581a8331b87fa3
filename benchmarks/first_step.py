"""Chapter 1's two programs timed on one device: the Adam step and the dense layer.

Chapter 1 counts their work (XLA's flops and bytes) instead of timing them, since its
simulated devices share the laptop's cores. This script times them on the first device JAX
finds (a TPU chip, a GPU, or one CPU device), at the chapter's shapes: the Adam step of a
two-layer MLP (512 -> 1,024 -> 10, a batch of 32) and ``tanh(x @ w)`` for a batch of 512 rows
of 1,024 into 256. It prints, and writes with ``--out``, each program's XLA flops, median
seconds per call and achieved GFLOP/s, with the date, the device and the JAX version.

    python benchmarks/first_step.py --out book/data/first_step_cpu.json
    source .whl-tpu/install.sh && python benchmarks/first_step.py --out $OUT/first_step_tpu.json
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib


def programs():
    """name -> (jitted function, its arguments), at chapter 1's shapes."""
    import jax
    import jax.numpy as jnp
    import optax

    tx = optax.adam(1e-3)

    def mlp_loss(params, x, y):
        hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
        logits = hidden @ params["w2"] + params["b2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def train_step(params, opt_state, x, y):
        grads = jax.grad(mlp_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    keys = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(keys[0], (512, 1024)) / 32,
        "b1": jnp.zeros(1024),
        "w2": jax.random.normal(keys[1], (1024, 10)) / 32,
        "b2": jnp.zeros(10),
    }
    x = jax.random.normal(keys[2], (32, 512))
    y = jax.random.randint(keys[3], (32,), 0, 10)
    layer_x = jax.random.normal(keys[2], (512, 1024))
    layer_w = jax.random.normal(keys[3], (1024, 256)) / 32
    return {
        "Adam step, MLP 512-1024-10, batch 32": (
            jax.jit(train_step),
            (params, tx.init(params), x, y),
        ),
        "dense layer tanh(x @ w), 512x1024 @ 1024x256": (
            jax.jit(lambda x, w: jnp.tanh(x @ w)),
            (layer_x, layer_w),
        ),
    }


def measure(calls: int) -> list[dict]:
    """Each program's flops, bytes accessed and median seconds per call."""
    from jaxdist_lessons import benchmark, compiled

    rows = []
    for name, (fn, args) in programs().items():
        executable = fn.lower(*args).compile()
        stats = compiled.stats(executable)
        call = functools.partial(executable, *args)
        seconds = benchmark.time_per_call(call, calls=calls)
        rows.append(
            {
                "program": name,
                "flops": stats.flops,
                "bytes_accessed": stats.bytes_accessed,
                "seconds": seconds,
                "gflops_per_second": stats.flops / seconds / 1e9,
            }
        )
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, help="the JSON file to write")
    parser.add_argument("--calls", type=int, default=200, help="timed calls each")
    args = parser.parse_args(argv)
    from jaxdist_lessons import benchmark

    report = {
        **benchmark.provenance(),
        "how": f"python benchmarks/first_step.py, one device, median of {args.calls} calls",
        "rows": measure(args.calls),
    }
    for row in report["rows"]:
        print(
            f"{row['program']}: {row['flops']:,.0f} flops, {row['seconds'] * 1e6:,.1f} us, "
            f"{row['gflops_per_second']:,.1f} GFLOP/s ({report['device_kind']})"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
