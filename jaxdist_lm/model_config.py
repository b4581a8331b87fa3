"""The model's shape: ``ModelConfig``, the presets, a Hugging Face config.json both
ways, and the arithmetic on a shape alone (parameters, training flops per token).

Standard library only: ``model.py`` builds the Flax model from a ``ModelConfig``, and
the book's planner (``jaxdist_lessons/planning``, which also runs in a browser) reads
this same file for its shapes, so the two cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's stretch of RoPE to a longer context (Hugging Face's rope_scaling,
    rope_type "llama3": factor 8 in Llama 3.1, 32 in 3.2)."""

    # Wavelengths longer than the original context over low_freq_factor are divided by
    # factor, those shorter than it over high_freq_factor kept, those between blended.
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    # Hugging Face's original_max_position_embeddings: 8192 in Llama 3
    original_context: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    num_layers: int
    width: int  # D
    num_heads: int  # N
    # N / K query heads share each key/value head (GQA)
    num_kv_heads: int  # K
    mlp_width: int  # F
    rope_theta: float = 10_000.0
    # the output projection reuses the embedding table
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    # E; 0: a dense MLP. Otherwise each MLP is E experts of width F
    num_experts: int = 0
    # experts per token
    top_k: int = 1
    # an expert's slots per group: ceil(top_k * group_size * factor / E)
    capacity_factor: float = 1.25
    # tokens routed together, a group (at most the sequence)
    group_size: int = 512
    # or "dropless": every choice computed, none dropped (dropless.py)
    dispatch: str = "capacity"
    # Dropless across 'expert': "padded" all_to_alls or "ragged" (ragged_all_to_all,
    # GPUs and TPUs; train.py picks it where the backend has it).
    exchange: str = "padded"
    # Switch's load-balancing loss, or "bias": DeepSeek-V3's routing bias
    balance: str = "loss"
    # experts every token goes through (DeepSeekMoE)
    shared_experts: int = 0
    # None: RoPE's frequencies as they are
    rope_scaling: RopeScaling | None = None
    # A, a head's width; 0: width / num_heads. Set, the heads need not add up to the
    # width (Gemma's, Qwen3's and MaxText's shapes): the projections map D to N x A.
    head_dim: int = 0

    # A: head_dim, or the width split evenly over the heads
    @property
    def head_width(self) -> int:
        return self.head_dim or self.width // self.num_heads


# Published shapes: Llama 3.2 1B (meta-llama/Llama-3.2-1B, config.json: 16 layers, width
# 2048, 32 heads, 8 KV heads, MLP 8192, tied embeddings) and Llama 3 8B and 70B ("The
# Llama 3 Herd of Models", arXiv:2407.21783, Table 3). All three use a 128,256-token
# vocabulary and RoPE base 500,000. "tiny" and "125m" are ours: tiny trains on a CPU in
# minutes; 125m has GPT-3 Small's depth and width.
PRESETS = {
    "tiny": ModelConfig(2048, 4, 128, 4, 2, 384),
    "125m": ModelConfig(32_768, 12, 768, 12, 4, 2048),
    "1b": ModelConfig(128_256, 16, 2048, 32, 8, 8192, 500_000.0, tie_embeddings=True),
    "8b": ModelConfig(128_256, 32, 4096, 32, 8, 14_336, 500_000.0),
    "70b": ModelConfig(128_256, 80, 8192, 64, 8, 28_672, 500_000.0),
}


def config_from_hf(path: str) -> ModelConfig:
    """A Hugging Face Llama config.json's shape as a ModelConfig; stops on what this
    model does not have."""
    try:
        with open(path) as f:
            hf: dict[str, Any] = json.load(f)
    except (OSError, ValueError) as error:
        reason = getattr(error, "strerror", None) or error
        raise SystemExit(
            f"{path}: {reason}; expected a Hugging Face config.json"
        ) from None
    if not isinstance(hf, dict):
        raise SystemExit(
            f"{path}: not a JSON object; expected a Hugging Face config.json"
        )
    name = path
    required = ("hidden_size", "num_attention_heads", "num_hidden_layers")
    required += ("intermediate_size", "vocab_size")
    if missing := [key for key in required if key not in hf]:
        raise SystemExit(f"{name}: no {', '.join(missing)}; is it a Llama config.json?")
    if hf.get("model_type", "llama") != "llama":
        raise SystemExit(f"{name}: model_type {hf['model_type']!r}, expected 'llama'")
    if hf.get("hidden_act", "silu") != "silu":
        raise SystemExit(f"{name}: hidden_act {hf['hidden_act']!r}; the MLP is SwiGLU")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise SystemExit(f"{name}: attention_bias or mlp_bias; this model has none")
    width, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or width // heads
    # transformers 4 (the Hub's Llama 3.x files) writes rope_theta and rope_scaling;
    # transformers 5 writes both into rope_parameters.
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or rope
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise SystemExit(f"{name}: rope_type {kind!r}; only 'default' and 'llama3'")
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        num_layers=hf["num_hidden_layers"],
        width=width,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        mlp_width=hf["intermediate_size"],
        rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta", 10_000.0)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        head_dim=0 if head_dim * heads == width else head_dim,
        # 1e-6: LlamaConfig's default
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_scaling=None
        if kind == "default"
        else RopeScaling(
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
            int(scaling["original_max_position_embeddings"]),
        ),
    )


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    """A config.json for a preset (a checkpoint that started from no Llama)."""
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "num_hidden_layers": c.num_layers,
        "hidden_size": c.width,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_width,
        "intermediate_size": c.mlp_width,
        "hidden_act": "silu",
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_embeddings,
        "torch_dtype": "float32",
    }
    if c.rope_scaling:
        s = c.rope_scaling
        hf["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_context,
        }
    return hf


def count_params(config: ModelConfig) -> int:
    """Parameters of a preset, from its shape alone."""
    c, per_layer = config, 0
    # q, out, k, v
    per_layer += c.width * c.head_width * (c.num_heads * 2 + c.num_kv_heads * 2)
    experts = max(c.num_experts, 1)
    # gate, up, down; norms
    per_layer += experts * 3 * c.width * c.mlp_width + 2 * c.width
    # the router, its bias, the shared experts
    per_layer += c.width * c.num_experts
    per_layer += c.num_experts if c.balance == "bias" else 0
    per_layer += 3 * c.width * c.mlp_width * c.shared_experts
    embeddings = c.vocab_size * c.width * (1 if c.tie_embeddings else 2)
    return c.num_layers * per_layer + embeddings + c.width


def flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """Training flops per token: 6 per weight used in a matmul, plus attention's scores
    (arXiv:2001.08361, §2.1; PaLM, arXiv:2204.02311, App. B)."""
    c = config
    # The embedding lookup is no matmul; tied, the table is used once, as the output
    # projection.
    matmul_params = count_params(c) - c.vocab_size * c.width * (
        0 if c.tie_embeddings else 1
    )
    # norms' scales multiply, no matmul
    matmul_params -= c.width * (2 * c.num_layers + 1)
    # a token passes through top_k experts of the E (dispatch not counted)
    if c.num_experts:
        matmul_params -= (
            c.num_layers * (c.num_experts - c.top_k) * 3 * c.width * c.mlp_width
        )
    # Attention's scores: 12 layers T (N A) a token; the causal mask not subtracted.
    return 6 * matmul_params + 12 * c.num_layers * seq_len * c.num_heads * c.head_width
