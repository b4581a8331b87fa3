"""Counting compilations: a recompile on every step shows up as a number, or an error (chapter 07_troubleshooting).

``count_compiles`` listens to the ``jax.monitoring`` events JAX itself records for every trace
and backend compilation, so it counts what JAX really did; with ``limit=`` it raises
``RecompileError`` when a function compiled more often than allowed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jaxdist_lessons._checks import positive_int


class RecompileError(RuntimeError):
    """A jitted function compiled more often than allowed inside ``count_compiles(..., limit=...)``."""


# jax.monitoring events that jax 0.10.2 records with a fun_name for every trace and compile.
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass
class CompileCounter:
    """Function names traced and compiled while the counter listened, in order."""

    name: str | None = None
    traced: list[str] = dataclasses.field(default_factory=list)
    compiled: list[str] = dataclasses.field(default_factory=list)

    @property
    def traces(self) -> int:
        """Traces of the watched function (of every function when no name was given)."""
        return len(self.traced) if self.name is None else self.traced.count(self.name)

    @property
    def compiles(self) -> int:
        """Backend compilations of the watched function (of every function when no name was given)."""
        return (
            len(self.compiled)
            if self.name is None
            else self.compiled.count(f"jit({self.name})")
        )

    def _listen(
        self, event: str, duration: float, fun_name: str = "", **_: Any
    ) -> None:
        if event == TRACE_EVENT:
            self.traced.append(fun_name)
        elif event == COMPILE_EVENT:
            self.compiled.append(fun_name)


def _function_name(fn: Callable | str | None) -> str | None:
    if fn is None or isinstance(fn, str):
        return fn
    name = getattr(fn, "__name__", None)
    if name is None:
        raise TypeError(
            f"cannot tell the name of {fn!r}: pass the function's name as a string"
        )
    return name


@contextlib.contextmanager
def count_compiles(
    fn: Callable | str | None = None, limit: int | None = None
) -> Iterator[CompileCounter]:
    """Count the traces and compilations of ``fn`` (a jitted function or its name; all
    if None) in the block.

    Functions are matched by name, as ``jax.monitoring`` reports them: two functions
    called ``step`` count together.

    With ``limit``, raise ``RecompileError`` on leaving the block if ``fn`` compiled
    more often.
    """
    if limit is not None:
        positive_int("limit", limit)
    counter = CompileCounter(_function_name(fn))
    jax.monitoring.register_event_duration_secs_listener(counter._listen)
    try:
        yield counter
    finally:
        jax.monitoring.unregister_event_duration_listener(counter._listen)
    if limit is not None and counter.compiles > limit:
        raise RecompileError(
            f"{counter.name or 'the block'} compiled {counter.compiles} times "
            f"(limit {limit}): its arguments changed shape, dtype or sharding between "
            "calls, or a static argument changed value. Fix: keep shapes fixed (pad or "
            "drop the last batch); run under jax.explain_cache_misses(True) to see "
            "what changed"
        )
