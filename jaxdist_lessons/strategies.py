"""The book's strategies, one vocabulary: a key each (what the package's functions take) and
the name its tables print (the planner's rows, the PyTorch page's words).

Each module that runs some of them picks its own with ``among``: ``memory.STRATEGIES`` (the
ZeRO/Megatron memory table), ``zero.ZERO_STAGES`` (chapter 06's steps), ``zero.LAYERED_STRATEGIES``,
``partitioning.RULES`` (chapter 09's rule sets) and the planner's layouts.
"""

from __future__ import annotations

NAMES: dict[str, str] = {
    "replicated": "replicated",  # every device holds everything: the baseline
    "data": "DP",
    "zero1": "ZeRO-1",
    "zero2": "ZeRO-2",
    "fsdp": "FSDP",
    "hsdp": "HSDP",
    "tensor": "TP",
    "hybrid": "DP+TP",
    "fsdp+tensor": "FSDP+TP",
    "hsdp+tensor": "HSDP+TP",  # replicas across nodes, FSDP and tensor inside each
    "sequence": "sequence",
    "fsdp_all_gathered": "FSDP, all layers gathered at once",
    "fsdp_per_layer": "FSDP, layer by layer",
}
STRATEGIES = tuple(NAMES)


def among(*keys: str) -> tuple[str, ...]:
    """``keys``, each one of ``STRATEGIES``: a module's own selection, in its order."""
    unknown = [k for k in keys if k not in NAMES]
    if unknown:
        raise ValueError(f"not strategies of the book: {unknown}; known: {STRATEGIES}")
    return keys
