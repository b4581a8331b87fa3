"""Argument checks shared by the package's modules."""

from __future__ import annotations

from typing import Any


def positive_int(name: str, value: Any) -> int:
    """``value`` if it is a positive integer (not a bool); otherwise ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value
