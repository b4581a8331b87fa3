"""What autodiff keeps from the forward pass for the backward pass, in bytes (chapter 06_performance).

``jax.ad_checkpoint.print_saved_residuals`` is JAX's only public view of the residuals, and it
prints; ``saved_residuals`` parses what it prints into records with their bytes. Remat
(``jax.checkpoint``) shrinks them; chapter 06_performance measures by how much.

Shape suffixes: see jaxdist_lessons.models.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.ad_checkpoint
import jax.numpy as jnp

from jaxdist_lessons import comms, compiled, hlo, precision
from jaxdist_lessons.models import transformer
from jaxdist_lessons.tables import Table


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
_RESIDUAL = re.compile(
    r"^(?P<dtype>[a-z][a-z0-9_]*)\[(?P<dims>[^\]]*)\]\s+(?P<source>.*)$"
)


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
        # every line is a residual: one we cannot read must not be dropped
        if m is None:
            raise ValueError(
                f"cannot read this line of print_saved_residuals: {line!r}"
            )
        shape = tuple(int(re.match(r"\d+", d)[0]) for d in m["dims"].split(",") if d)
        nbytes = math.prod(shape) * hlo.dtype_bytes(m["dtype"])
        found.append(Residual(m["dtype"], shape, nbytes, m["source"]))
    return found


def residual_bytes(fn: Callable, *args: Any) -> int:
    """Bytes of the residuals that are not inputs: the activations the backward pass needs stored."""
    return sum(r.nbytes for r in saved_residuals(fn, *args) if not r.is_argument)


REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "full (save only block inputs)": "full",
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
"""Remat policies for ``transformer.Decoder(remat_policy=...)``, by the name a table shows."""


def remat_table(decoder: Any, params: Any, tokens: jax.Array) -> Table:
    """The gradient of ``decoder``'s next-token loss under each of ``REMAT_POLICIES``.

    Columns: the saved residuals' bytes, the dots of the lowered and of the compiled program, the
    compiled flops and temporary bytes. ``table.values`` holds the rows.
    """
    rows = []
    for name, policy in REMAT_POLICIES.items():
        model = decoder.clone(remat_policy=policy)
        loss = functools.partial(transformer.next_token_loss, model, tokens_BT=tokens)
        lowered = jax.jit(jax.grad(loss)).lower(params)
        program = lowered.compile()
        stats = compiled.stats(program)
        rows.append(
            [
                name,
                residual_bytes(loss, params),
                hlo.op_counts(lowered.as_text(dialect="hlo"))["dot"],
                hlo.op_counts(program.as_text())["dot"],
                stats.flops,
                stats.temp_bytes,
            ]
        )
    headers = ["remat policy", "saved residuals (B)", "dots, lowered"]
    headers += [f"dots, compiled ({jax.default_backend()})", "flops", "temp bytes"]
    batch, length = tokens.shape[0], tokens.shape[1] - 1
    title = f"Gradient of the decoder's loss, {batch} sequences of {length} tokens, one device"
    return Table(headers, rows, title=title)


PRECISIONS = {
    "fp32": (jnp.float32, jnp.float32),
    "bf16 compute, fp32 params": (jnp.bfloat16, jnp.float32),
    "bf16 everything": (jnp.bfloat16, jnp.bfloat16),
}
"""``(dtype, param_dtype)`` of a Flax model, by the name a table shows."""


def precision_table(decoder: Any, params: Any, tokens: jax.Array) -> Table:
    """``decoder``'s parameter bytes and saved residual bytes in each of ``PRECISIONS``."""
    rows = []
    for name, (dtype, param_dtype) in PRECISIONS.items():
        model = decoder.clone(dtype=dtype, param_dtype=param_dtype)
        loss = functools.partial(transformer.next_token_loss, model, tokens_BT=tokens)
        cast = precision.Policy(param_dtype=param_dtype).to_param(params)
        rows.append([name, comms.tree_bytes(cast), residual_bytes(loss, cast)])
    headers = ["precision", "parameter bytes", "saved residual bytes"]
    return Table(headers, rows, title="The decoder in three precisions")
