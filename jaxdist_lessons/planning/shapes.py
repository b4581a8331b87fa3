"""The model the planner plans for: a Llama-style decoder's shape (``LMShape``, the field
names of the recipe's ``ModelConfig``), the recipe's presets, and the arithmetic on them:
parameters, training flops per token, each weight's shape and mesh axes, and the Hugging
Face config.json that the recipe's ``--model-config`` reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class LMShape:
    """A Llama-style decoder's shape, with the field names of the recipe's ``ModelConfig``."""

    vocab_size: int
    num_layers: int
    width: int  # D
    num_heads: int  # N
    num_kv_heads: int  # K
    mlp_width: int  # F
    tie_embeddings: bool = False
    num_experts: int = 0  # E; 0: a dense MLP
    top_k: int = 1
    capacity_factor: float = 1.25
    group_size: int = 512

    @property
    def head_width(self) -> int:  # A
        return self.width // self.num_heads


# examples/lm/model.py's PRESETS (tests/planning/test_shapes.py checks that they are equal).
PRESETS = {
    "tiny": LMShape(2048, 4, 128, 4, 2, 384),
    "125m": LMShape(32_768, 12, 768, 12, 4, 2048),
    "1b": LMShape(128_256, 16, 2048, 32, 8, 8192, tie_embeddings=True),
    "8b": LMShape(128_256, 32, 4096, 32, 8, 14_336),
    "70b": LMShape(128_256, 80, 8192, 64, 8, 28_672),
}


def attention_weights(m: LMShape) -> int:
    """One layer's Q, K, V and output projections."""
    return m.width * m.head_width * (2 * m.num_heads + 2 * m.num_kv_heads)


def mlp_weights(m: LMShape) -> int:
    """One layer's MLP: gate, up and down, for each expert; and the router."""
    return max(m.num_experts, 1) * 3 * m.width * m.mlp_width + m.width * m.num_experts


def param_count(m: LMShape) -> int:
    """Parameters (``model.count_params``)."""
    layers = m.num_layers * (attention_weights(m) + mlp_weights(m) + 2 * m.width)
    return layers + m.vocab_size * m.width * (1 if m.tie_embeddings else 2) + m.width


def model_flops_per_token(m: LMShape, seq_len: int) -> int:
    """Training flops per token (``model.flops_per_token``): 6 per matmul weight a token uses,
    plus attention's 12 L T N A."""
    used = param_count(m) - m.vocab_size * m.width * (0 if m.tie_embeddings else 1)
    used -= m.width * (2 * m.num_layers + 1)
    if m.num_experts:
        used -= m.num_layers * (m.num_experts - m.top_k) * 3 * m.width * m.mlp_width
    return 6 * used + 12 * m.num_layers * seq_len * m.num_heads * m.head_width


# Each weight of the recipe: its shape and the mesh axis splitting each dimension (layout.RULES).
def weight_shapes(m: LMShape) -> list[tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """(shape, mesh axes) of every weight; the layers' weights are stacked on a leading L."""
    D, N, K, A, F, E, V, L = (m.width, m.num_heads, m.num_kv_heads, m.head_width,  # noqa: N806
                              m.mlp_width, m.num_experts, m.vocab_size, m.num_layers)  # fmt: skip
    out = [((L, D), (None, "fsdp"))] * 2  # the two norms
    out += [((L, D, N, A), (None, "fsdp", "tensor", None))]
    out += [((L, D, K, A), (None, "fsdp", "tensor", None))] * 2
    out += [((L, N, A, D), (None, "tensor", None, "fsdp"))]
    if E:
        out += [((L, D, E), (None, "fsdp", None))]
        out += [((L, E, D, F), (None, "expert", "fsdp", "tensor"))] * 2
        out += [((L, E, F, D), (None, "expert", "tensor", "fsdp"))]
    else:
        out += [((L, D, F), (None, "fsdp", "tensor"))] * 2 + [
            ((L, F, D), (None, "tensor", "fsdp"))
        ]
    out += [((V, D), ("tensor", "fsdp")), ((D,), ("fsdp",))]  # embedding, final norm
    if not m.tie_embeddings:
        out += [((D, V), ("fsdp", "tensor"))]
    return out


def hf_config(m: LMShape) -> dict[str, Any]:
    """A shape as the Hugging Face Llama config.json that ``--model-config`` reads
    (examples/lm/model.py's ``config_from_hf``)."""
    return {"model_type": "llama", "hidden_act": "silu", "vocab_size": m.vocab_size,
            "num_hidden_layers": m.num_layers, "hidden_size": m.width,
            "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads,
            "intermediate_size": m.mlp_width, "tie_word_embeddings": m.tie_embeddings}  # fmt: skip
