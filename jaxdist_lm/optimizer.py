"""AdamW on a warmup and cosine schedule with global-norm clipping (routing biases by
sign descent), its moments kept in --moments' dtype between steps."""

import jax
import jax.numpy as jnp
import optax

from .run_config import RunConfig


def make_optimizer(run: RunConfig) -> optax.GradientTransformation:
    """AdamW, warmup + cosine decay, global-norm clipping; only the kernels decay."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        run.learning_rate,
        run.warmup_steps,
        max(run.total_steps or run.steps, run.warmup_steps + 1),
        end_value=run.learning_rate / 10,
    )

    # Only matmul weights ('kernel') decay; not 'scale' nor 'embedding'.
    def decay(params):
        return jax.tree_util.tree_map_with_path(
            lambda p, _: "kernel" in jax.tree_util.keystr(p), params
        )

    # Under jit the gradients are sharded arrays, and clip_by_global_norm sums over all
    # of them: the clipping sees the whole model's norm, whatever the mesh.
    adamw = optax.chain(
        optax.clip_by_global_norm(run.clip_norm),
        optax.adamw(
            schedule, b1=0.9, b2=0.95, weight_decay=run.weight_decay, mask=decay
        ),
    )
    moments = jnp.dtype(run.moments)
    if run.balance != "bias":
        return kept_in(moments, adamw)

    # --balance bias: the experts' routing biases move by sign descent, --bias-rate a
    # step against their gradient (load - 1/E: experts.Experts.route); AdamW the rest.
    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda p, _: (
                "bias" if "router_bias" in jax.tree_util.keystr(p) else "adamw"
            ),
            params,
        )

    sign_descent = optax.chain(optax.scale_by_sign(), optax.scale(-run.bias_rate))
    both = optax.multi_transform({"adamw": adamw, "bias": sign_descent}, labels)
    return kept_in(moments, both)


def kept_in(dtype, inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` with its floating-point state (Adam's moments) kept in ``dtype``
    between steps, updated in float32 (bfloat16: 4 bytes a weight instead of 8)."""
    if dtype == jnp.float32:
        return inner
    floats = lambda x: jnp.issubdtype(x.dtype, jnp.floating)
    to = lambda tree, dtype: jax.tree.map(
        lambda x: x.astype(dtype) if floats(x) else x, tree
    )

    def update(updates, state, params=None):
        updates, state = inner.update(updates, to(state, jnp.float32), params)
        return updates, to(state, dtype)

    return optax.GradientTransformation(lambda p: to(inner.init(p), dtype), update)
