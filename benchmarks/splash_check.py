"""Splash attention against XLA's, at the 125m preset's attention shape: errors and times.

The recipe's three attentions (jaxdist_lm: splash.splash_attention, JAX's Pallas kernel
for TPUs; attention.chunked_attention; XLA's jax.nn.dot_product_attention) on 2 rows of
2,048 tokens, 12 query heads sharing 4 key/value heads of 64 (``--model 125m``), causal,
and causal inside documents (EOD about every 400 tokens, as ``--eod-id`` masks them).
For float32 and bfloat16 inputs it prints each one's largest error in the output and in
the gradients w.r.t. q, k and v, against XLA's attention at float32 precision
("highest") on the same inputs, and the median time of a forward and backward pass
after a warm-up.

The check: in float32, splash's relative error (the largest absolute error over the
largest absolute reference value, for the output and each gradient) is at most
F32_TOLERANCE, or at most twice that of XLA's own float32 attention at the backend's
default matmul precision (on a TPU, float32 products may run in bfloat16 passes: the
kernel is then held to what XLA gives). It exits 1 when the check fails or could not
run. Each part runs on its own: a failure prints its error and the rest goes on.

Off a TPU the kernel runs interpreted (exact, slow): ``--seq-len 512`` keeps a CPU run
to about a minute.

    python benchmarks/splash_check.py                    # on the TPU: under 90 s
    python benchmarks/splash_check.py --seq-len 512      # a CPU's check of the script
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's jaxdist_lm, where it is not installed
from jaxdist_lm import attention as attention_lib  # noqa: E402
from jaxdist_lm import splash  # noqa: E402

B, N, K, A = 2, 12, 4, 64  # the 125m preset: 12 heads of 64, 4 key/value heads
F32_TOLERANCE = 1e-3
DOCUMENT_LENGTH = 400  # an EOD about this often
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PARTS = ("out", "d q", "d k", "d v")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case")
    parser.add_argument(
        "--budget", type=float, default=80, help="seconds; later cases are skipped"
    )
    parser.add_argument(
        "--blocks",
        action="store_true",
        help="instead: time the kernel's block sizes (splash.SPLASH_BLOCKS' choice)",
    )
    return parser.parse_args(argv)


def block_sizes(size: int, fused: bool):
    """Every block of the kernel ``size``; one fused backward kernel or two."""
    names = ("q", "kv", "kv_compute", "q_dkv", "kv_dkv", "kv_dkv_compute")
    blocks = {f"block_{name}": size for name in names}
    if not fused:
        blocks |= {"block_q_dq": size, "block_kv_dq": size}
    return splash.kernels.BlockSizes(**blocks, use_fused_bwd_kernel=fused)


def kernel_ms(mask, blocks, q, k, v, d_out, repeats: int) -> list[float]:
    """The kernel's forward, and forward + backward, median milliseconds."""
    kernel = splash.kernels.make_splash_mha(
        mask, block_sizes=blocks, head_shards=1, q_seq_shards=1
    )
    forward = jax.jit(jax.vmap(kernel))
    loss = lambda q, k, v: jnp.sum(forward(q, k, v) * d_out)
    both = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready((forward(q, k, v), both(q, k, v)))  # compiled
    return [1e3 * median_seconds(run, (q, k, v), repeats) for run in (forward, both)]


def time_blocks(repeats: int) -> None:
    """The kernel's forward and forward + backward times at 125m's attention (16 rows
    of 2,048 tokens) and 1b's (4 rows, 32 heads sharing 8), bfloat16, by block size."""
    shapes = {"125m": (16, 2048, 12, 4), "1b": (4, 2048, 32, 8)}
    for name, (rows, length, heads, kv_heads) in shapes.items():
        keys = jax.random.split(jax.random.key(0), 4)
        q, d_out = (
            jax.random.normal(key, (rows, heads, length, A)) for key in keys[:2]
        )
        k, v = (jax.random.normal(key, (rows, kv_heads, length, A)) for key in keys[2:])
        q, k, v, d_out = (x.astype(jnp.bfloat16) for x in (q, k, v, d_out))
        causal = splash.kernels.CausalMask((length, length))
        mask = splash.kernels.MultiHeadMask([causal] * heads)
        for size in (256, 512, 1024, 2048):
            for fused in (False, True):
                label = f"{name} blocks of {size:4} fused backward {fused!s:5}"
                try:
                    blocks = block_sizes(size, fused)
                    ms = kernel_ms(mask, blocks, q, k, v, d_out, repeats)
                    print(
                        f"{label}: forward {ms[0]:.2f} ms, and backward {ms[1]:.2f} ms"
                    )
                except Exception as error:  # print it and go on
                    print(f"{label}: failed: {type(error).__name__}: {error}"[:300])


def inputs(length: int, dtype) -> tuple[list[jax.Array], jax.Array]:
    """q, k, v, the output's cotangent (in ``dtype``) and EOD-like document starts."""
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(B, length, N, A), (B, length, K, A), (B, length, K, A)]
    shapes.append(shapes[0])  # the output's cotangent
    arrays = [jax.random.normal(key, shape, dtype) for key, shape in zip(keys, shapes)]
    rng = np.random.default_rng(0)
    tokens_BT = np.where(rng.random((B, length)) < 1 / DOCUMENT_LENGTH, 0, 1)
    return arrays, attention_lib.document_starts(jnp.asarray(tokens_BT), 0)


def attentions(length: int) -> dict:
    """name -> attend(q, k, v, starts or None), each as the recipe calls it."""
    positions_T = jnp.arange(length)
    chunked = lambda q, k, v, s: attention_lib.chunked_attention(
        q, k, v, positions_T, positions_T, attention_lib.BLOCK, s, s
    )
    xla = lambda q, k, v, s: jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=attention_lib.document_mask(s),
        is_causal=True,
        implementation="xla",
    )
    return {"splash": splash.splash_attention, "chunked": chunked, "xla": xla}


def forward_and_backward(attend, starts_BT):
    """A jitted (q, k, v, d_out) -> (output, d q, d k, d v)."""

    def run(q, k, v, d_out):
        loss = lambda q, k, v: jnp.sum(
            attend(q, k, v, starts_BT).astype(jnp.float32) * d_out.astype(jnp.float32)
        )
        out = attend(q, k, v, starts_BT)
        return out, *jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return jax.jit(run)


def relative_errors(got, expected) -> list[float]:
    """Per part: the largest absolute error over the largest absolute reference."""
    return [
        float(jnp.max(jnp.abs(g.astype(jnp.float32) - e)) / jnp.max(jnp.abs(e)))
        for g, e in zip(got, expected)
    ]


def median_seconds(run, args, repeats: int) -> float:
    """The median wall time of ``run(*args)`` after its warm-up (already compiled)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.blocks:
        time_blocks(args.repeats)
        return 0
    began = time.perf_counter()
    device = jax.devices()[0]
    try:
        blocks = f"splash blocks of {splash.splash_blocks(args.seq_len).block_q}"
    except ValueError as error:
        blocks = str(error)
    interpreted = "" if jax.default_backend() == "tpu" else " (interpreted)"
    print(
        f"{device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"{datetime.date.today()}; B={B} T={args.seq_len} N={N} K={K} A={A}; "
        f"{blocks}{interpreted}"
    )
    print(
        f"{'dtype':9} {'masking':10} {'attention':9} "
        + " ".join(f"{p:>9}" for p in PARTS)
        + f" {'max abs':>9} {'fwd+bwd ms':>11}"
    )
    errors = {}
    for dtype_name, dtype in DTYPES.items():
        (q, k, v, d_out), starts_BT = inputs(args.seq_len, dtype)
        for masking, starts in (("causal", None), ("documents", starts_BT)):
            reference = None
            try:
                with jax.default_matmul_precision("highest"):
                    exact = forward_and_backward(
                        attentions(args.seq_len)["xla"], starts
                    )
                    as_f32 = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
                    reference = [x.astype(jnp.float32) for x in exact(*as_f32)]
            except Exception:  # print it and go on
                print(f"{dtype_name} {masking}: the reference failed")
                traceback.print_exc()
            for name, attend in attentions(args.seq_len).items():
                label = f"{dtype_name:9} {masking:10} {name:9}"
                if time.perf_counter() - began > args.budget:
                    print(f"{label} skipped: past --budget {args.budget:.0f} s")
                    continue
                try:
                    run = forward_and_backward(attend, starts)
                    got = jax.block_until_ready(run(q, k, v, d_out))
                    ms = 1e3 * median_seconds(run, (q, k, v, d_out), args.repeats)
                except Exception as error:  # print it and go on
                    print(f"{label} failed: {type(error).__name__}: {error}"[:400])
                    continue
                if reference is None:
                    print(f"{label} {'':>39} {ms:11.2f}")
                    continue
                rel = relative_errors(got, reference)
                worst = max(
                    float(jnp.max(jnp.abs(g.astype(jnp.float32) - e)))
                    for g, e in zip(got, reference)
                )
                errors[dtype_name, masking, name] = rel
                print(
                    f"{label} "
                    + " ".join(f"{r:9.1e}" for r in rel)
                    + f" {worst:9.1e} {ms:11.2f}"
                )
    failures = check(errors, "causal") + check(errors, "documents")
    print(f"{time.perf_counter() - began:.0f} s")
    for failure in failures:
        print(failure)
    return 1 if failures else 0


def check(errors: dict, masking: str) -> list[str]:
    """Why float32 splash fails its tolerance under ``masking``, if it does."""
    got = errors.get(("float32", masking, "splash"))
    if got is None:
        return [f"FAIL float32 {masking}: splash's errors were not measured"]
    xla = errors.get(("float32", masking, "xla"), [0.0] * len(PARTS))
    return [
        f"FAIL float32 {masking} {part}: splash's relative error {g:.1e} > "
        f"{F32_TOLERANCE:.0e} and > 2 x XLA's {x:.1e}"
        for part, g, x in zip(PARTS, got, xla)
        if g > max(F32_TOLERANCE, 2 * x)
    ]


if __name__ == "__main__":
    sys.exit(main())
