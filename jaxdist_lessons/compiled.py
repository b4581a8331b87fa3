"""Read what the compiler says about a program: flops, bytes and memory per device.

``jax.jit(f).lower(*args).compile()`` is the program XLA will run. After SPMD
partitioning it is the program of *one* device, so its cost and memory figures are
per device. Chapters use these numbers to check the arithmetic in the prose, and
``memory_report`` sets several programs' memory side by side. (The program's text, its
instructions and collectives, is ``hlo``'s to read.)
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
from jax.experimental.compilation_cache import compilation_cache as persistent_cache

from jaxdist_lessons import hlo
from jaxdist_lessons.tables import Table


@dataclasses.dataclass(frozen=True)
class CompiledStats:
    """Per-device figures of a compiled program, as XLA reports them."""

    flops: float
    bytes_accessed: float
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    peak_bytes: int
    """XLA's ``peak_memory_in_bytes``. Not the program's peak on every backend: on XLA:CPU (jax 0.10.2)
    it comes to about the arguments plus the outputs, less what is aliased, and leaves the
    temporaries out, so it can be far below what the program holds. ``live_bytes`` counts them."""

    @property
    def live_bytes(self) -> int:
        """Arguments, outputs and temporaries, less what the outputs reuse from donated inputs."""
        return (
            self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes
        )


def compile_fn(fn: Callable, *args: Any, **kwargs: Any) -> jax.stages.Compiled:
    """Compile ``fn`` (jitted if it is not already) for these arguments, without running it."""
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return jitted.lower(*args, **kwargs).compile()


Result = TypeVar("Result")


def compiler_log(compile: Callable[[], Result]) -> tuple[Result, list[str]]:
    """``compile()``'s result and the lines XLA wrote to the process's standard error
    meanwhile, such as the SPMD partitioner's warnings. XLA writes them from C++ to file
    descriptor 2, which a notebook never shows and Python's ``sys.stderr`` never sees:
    they are read from a temporary file put in its place. The persistent compilation
    cache is off meanwhile, as a program found there is not compiled, and says nothing."""
    sys.stderr.flush()
    saved_fd, cache = os.dup(2), jax.config.jax_enable_compilation_cache
    with tempfile.TemporaryFile(mode="w+") as log:
        os.dup2(log.fileno(), 2)
        try:  # JAX decides once whether to use the cache, unless told to decide again
            jax.config.update("jax_enable_compilation_cache", False)
            persistent_cache.reset_cache()
            result = compile()
        finally:
            jax.config.update("jax_enable_compilation_cache", cache)
            persistent_cache.reset_cache()
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
        log.seek(0)
        return result, log.read().splitlines()


def stats(compiled: jax.stages.Compiled) -> CompiledStats:
    """Flops, bytes accessed and memory of a compiled program, per device."""
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, (list, tuple)):  # older jax returned one dict per program
        cost = cost[0]
    memory = compiled.memory_analysis()
    if memory is None:
        raise ValueError(
            f"this backend ({jax.default_backend()}) reports no memory analysis for compiled programs"
        )
    return CompiledStats(
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes,
        alias_bytes=memory.alias_size_in_bytes,
        peak_bytes=memory.peak_memory_in_bytes,
    )


def compiled_stats(fn: Callable, *args: Any, **kwargs: Any) -> CompiledStats:
    """``stats(compile_fn(fn, *args))``: what one device will do and hold when ``fn`` runs."""
    return stats(compile_fn(fn, *args, **kwargs))


MEMORY_HEADERS = ["arguments", "outputs", "temporaries", "aliased", "live", "XLA peak"]


def memory_row(stats: CompiledStats) -> list[int]:
    """A compiled program's memory per device, as a row under ``MEMORY_HEADERS``."""
    return [
        stats.argument_bytes,
        stats.output_bytes,
        stats.temp_bytes,
        stats.alias_bytes,
        stats.live_bytes,
        stats.peak_bytes,
    ]


def memory_report(
    programs: Mapping[str, jax.stages.Compiled], title: str = ""
) -> Table:
    """A table of compiled programs' memory per device, one row per program, under ``MEMORY_HEADERS``.

    "live" bounds what the program holds at once; "XLA peak" is ``peak_memory_in_bytes``, which on
    XLA:CPU leaves the temporaries out (see ``CompiledStats.peak_bytes``).
    """
    return Table(
        ["program", *MEMORY_HEADERS],
        [[name, *memory_row(stats(program))] for name, program in programs.items()],
        title=title,
    )


def instruction_table(
    functions: Mapping[str, Callable], *args: Any, title: str = ""
) -> Table:
    """Instructions of each jitted function's lowered program (and its calls) and compiled program (and its fusions).

    What JAX writes against what XLA runs: a nested ``jit`` shows in the lowered program as calls,
    which XLA inlines. ``table.values`` holds the rows.
    """
    rows = []
    for label, fn in functions.items():
        lowered = fn.lower(*args)
        asked, run = lowered.as_text(dialect="hlo"), lowered.compile().as_text()
        rows.append(
            [
                label,
                hlo.instruction_count(asked),
                hlo.op_counts(asked)["call"],
                hlo.instruction_count(run),
                hlo.op_counts(run)["fusion"],
            ]
        )
    headers = [
        "function",
        "lowered instructions",
        "of them calls",
        "compiled instructions",
    ]
    return Table([*headers, "fusions"], rows, title=title)
