"""Splash attention: JAX's Pallas kernel for TPUs, causal, with packed documents.

FlashAttention's blocks (arXiv:2205.14135), skipping those above the causal diagonal;
grouped key/value heads never repeated. Off a TPU it runs interpreted: exact, but slow.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as kernels

# A block spans whole 128-lane vector registers; the largest that divides the sequence
# is taken. On a TPU v5e, 1,024 with the fused backward kernel ran 125m's attention
# (16 x 2,048 tokens, 12 heads of 64) forward and backward in 9.4 ms, against 12.8 ms
# at 512 with separate dq and dk/dv kernels (MaxText's default, its sa_block_*
# settings); 2,048 did not fit the kernel's on-chip memory (splash_check.py --blocks).
LANES = 128
SPLASH_BLOCKS = (1024, 512, 256, 128)


def splash_blocks(length: int) -> kernels.BlockSizes:
    """The kernel's blocks for ``length`` tokens, forward and backward: the largest of
    SPLASH_BLOCKS that divides it."""
    if length % LANES:
        raise ValueError(
            f"splash attention needs a sequence length that is a multiple of {LANES}; "
            f"got {length}: use --attention chunked or another --seq-len"
        )
    size = next(block for block in SPLASH_BLOCKS if length % block == 0)
    return kernels.BlockSizes(
        block_q=size,
        block_kv=size,
        block_kv_compute=size,
        block_q_dkv=size,
        block_kv_dkv=size,
        block_kv_dkv_compute=size,
        # dq, dk and dv in one kernel: measured faster
        use_fused_bwd_kernel=True,
    )


@functools.cache
def splash_kernel(num_heads: int, length: int, interpret: bool):
    """The causal kernel for ``num_heads`` query heads of ``length`` tokens, built once
    a shape: its mask's block maps are made on the host."""
    causal = kernels.CausalMask((length, length))
    mask = kernels.MultiHeadMask([causal] * num_heads)
    # Concrete, even when first asked for inside a trace: the cache outlives it.
    with jax.ensure_compile_time_eval():
        kernel = kernels.make_splash_mha(
            mask,
            block_sizes=splash_blocks(length),
            head_shards=1,
            q_seq_shards=1,
            interpret=interpret,
        )
    # The block maps as numpy: constants of each program, not device arrays it closes
    # over (closed over inside shard_map, JAX 0.10.2 fails to run the backward pass of
    # a jitted forward on its own).
    return jax.tree.map(np.asarray, kernel)


def program_platform() -> str:
    """The platform of the traced program: the current mesh's, else this machine's."""
    mesh = jax.sharding.get_abstract_mesh()
    return jax.default_backend() if mesh.empty else mesh.abstract_device.platform


def splash_attention(
    q_BTNA: jax.Array,
    k_BTKA: jax.Array,
    v_BTKA: jax.Array,
    starts_BT: jax.Array | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Causal attention by the splash kernel, in the queries' dtype; interpreted by
    default when the program is not for a TPU."""
    _, T, N, A = q_BTNA.shape
    if interpret is None:
        interpret = program_platform() != "tpu"
    kernel = splash_kernel(N, T, interpret)
    # The kernel does not scale the scores, and takes heads before tokens.
    q_BNTA = (q_BTNA * jnp.asarray(A**-0.5, q_BTNA.dtype)).transpose(0, 2, 1, 3)
    k_BKTA, v_BKTA = (x.transpose(0, 2, 1, 3) for x in (k_BTKA, v_BTKA))
    if starts_BT is None:
        out_BNTA = jax.vmap(kernel)(q_BNTA, k_BKTA, v_BKTA)
    else:
        # A query sees a key only where their segment ids, the document starts, match.
        documents = kernels.SegmentIds(q=starts_BT, kv=starts_BT)
        out_BNTA = jax.vmap(kernel)(q_BNTA, k_BKTA, v_BKTA, documents)
    return out_BNTA.transpose(0, 2, 1, 3)
