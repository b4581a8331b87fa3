"""What autodiff keeps from the forward pass for the backward pass, in bytes (chapter 6).

``jax.ad_checkpoint.print_saved_residuals`` is JAX's only public view of the residuals, and it
prints; ``saved_residuals`` parses what it prints into records with their bytes. Remat
(``jax.checkpoint``) shrinks them; chapter 6 measures by how much.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.ad_checkpoint

from jaxdist_lessons import hlo


@dataclasses.dataclass(frozen=True)
class Residual:
    """One array kept from the forward pass for the backward pass."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    source: str

    @property
    def is_argument(self) -> bool:
        """Whether it is one of the function's inputs (kept anyway, so it costs nothing extra)."""
        return self.source.startswith("from the argument")


# ``f32[64,256] output of ...``; on Explicit axes a sharded dimension reads ``64@data`` (still the global size).
_RESIDUAL = re.compile(r"^(?P<dtype>[a-z][a-z0-9_]*)\[(?P<dims>[^\]]*)\]\s+(?P<source>.*)$")


def saved_residuals(fn: Callable, *args: Any) -> list[Residual]:
    """The residuals ``jax.vjp(fn, *args)`` keeps, parsed from ``jax.ad_checkpoint.print_saved_residuals``.

    Shapes and bytes are global: on a mesh, each device keeps its shard of them.
    """
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    found = []
    for line in filter(None, map(str.strip, out.getvalue().splitlines())):
        m = _RESIDUAL.match(line)
        if m is None:  # every line is a residual: one we cannot read must not be dropped
            raise ValueError(f"cannot read this line of print_saved_residuals: {line!r}")
        shape = tuple(int(re.match(r"\d+", d)[0]) for d in m["dims"].split(",") if d)
        nbytes = math.prod(shape) * hlo.dtype_bytes(m["dtype"])
        found.append(Residual(m["dtype"], shape, nbytes, m["source"]))
    return found


def residual_bytes(fn: Callable, *args: Any) -> int:
    """Bytes of the residuals that are not inputs: the activations the backward pass needs stored."""
    return sum(r.nbytes for r in saved_residuals(fn, *args) if not r.is_argument)
