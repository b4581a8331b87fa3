"""Activation bytes a Transformer block keeps for its backward pass (Korthikanti et al. 2022).

Standard library only, so that the planner (``plan.py``) also runs in the browser, in the
"Plan your run" page's Pyodide; ``costmodel`` imports it from here.
"""

from __future__ import annotations


def layer_activation_bytes(
    seq_len: int,
    batch: int,
    hidden: int,
    heads: int,
    tensor: int = 1,
    flash_attention: bool = False,
) -> float:
    """Activation bytes one block keeps under ``tensor``-way tensor parallelism, 16-bit activations.

    Korthikanti et al. 2022, eq. (2): ``s b h (10 + 24/t + 5 a s / (h t))``; with ``t = 1`` it is
    eq. (1), ``memory.transformer_layer_activation_bytes``.
    """
    attention = 0 if flash_attention else 5 * heads * seq_len / (hidden * tensor)
    return seq_len * batch * hidden * (10 + 24 / tensor + attention)
