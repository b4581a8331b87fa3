"""Activation bytes a Transformer block keeps for its backward pass (Korthikanti et al. 2022).

Standard library only, so that the planner (``planning``) also runs in the browser, in the
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
    sequence_parallel: bool = False,
) -> float:
    """Activation bytes one block keeps under ``tensor``-way tensor parallelism, 16-bit activations.

    Korthikanti et al. 2022, eq. (2): ``s b h (10 + 24/t + 5 a s / (h t))``; with ``t = 1`` it is
    eq. (1), ``memory.transformer_layer_activation_bytes``. With ``sequence_parallel``
    (their section 4.2.2), the layer norms' and dropouts' 10 split too: ``s b h (34/t + 5 a s / (h t))``.
    """
    attention = 0 if flash_attention else 5 * heads * seq_len / (hidden * tensor)
    rest = 34 / tensor if sequence_parallel else 10 + 24 / tensor
    return seq_len * batch * hidden * (rest + attention)
