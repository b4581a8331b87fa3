"""The weights the planner splits: each layer's attention and MLP weights, and every weight's
shape and mesh axes, for the recipe's own ``ModelConfig``.

The shape itself, the presets, the parameter count, the flops per token and the Hugging
Face config.json come from the recipe's ``jaxdist_lm/model_config.py`` (standard library
only), imported: one file, read by the recipe and the planner alike.
"""

from __future__ import annotations

from jaxdist_lm.model_config import ModelConfig


def attention_weights(m: ModelConfig) -> int:
    """One layer's Q, K, V and output projections."""
    return m.width * m.head_width * (2 * m.num_heads + 2 * m.num_kv_heads)


def mlp_weights(m: ModelConfig) -> int:
    """One layer's MLP: gate, up and down, for each expert; and the router."""
    return max(m.num_experts, 1) * 3 * m.width * m.mlp_width + m.width * m.num_experts


# Each weight of the recipe: its shape and the mesh axis splitting each dimension (mesh_spec.RULES).
def weight_shapes(
    m: ModelConfig,
) -> list[tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """(shape, mesh axes) of every weight; the layers' weights are stacked on a leading axis of layers."""
    D, N, K, A, F, E, V, layers = (
        m.width,
        m.num_heads,
        m.num_kv_heads,
        m.head_width,
        m.mlp_width,
        m.num_experts,
        m.vocab_size,
        m.num_layers,
    )
    out = [((layers, D), (None, "fsdp"))] * 2  # the two norms
    out += [((layers, D, N, A), (None, "fsdp", "tensor", None))]
    out += [((layers, D, K, A), (None, "fsdp", "tensor", None))] * 2
    out += [((layers, N, A, D), (None, "tensor", None, "fsdp"))]
    if E:
        out += [((layers, D, E), (None, "fsdp", None))]
        out += [((layers, E, D, F), (None, "expert", "fsdp", "tensor"))] * 2
        out += [((layers, E, F, D), (None, "expert", "tensor", "fsdp"))]
    else:
        out += [((layers, D, F), (None, "fsdp", "tensor"))] * 2 + [
            ((layers, F, D), (None, "tensor", "fsdp"))
        ]
    out += [((V, D), ("tensor", "fsdp")), ((D,), ("fsdp",))]  # embedding, final norm
    if not m.tie_embeddings:
        out += [((D, V), ("fsdp", "tensor"))]
    return out
