"""The exercises of ``book/appendix_seed_errata.md``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxdist_lessons.exercises.checking import (
    Exercise,
    Hint,
    _number,
    _runs,
    equals,
    named,
)


def exercises(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    return {
        1: Exercise(
            asks="(the exception's class name, the chapter's number)",
            expected=None,
            kind="tuple",
            why="Explicit axes need the sharding of every ambiguous result stated; chapter 05_resnet50 "
            "shows it, and Auto axes (or out_sharding=) fix it.",
            parts=(
                Exercise(
                    asks="an exception class name",
                    expected="ShardingTypeError",
                    kind="name",
                    aliases={"jax.sharding.shardingtypeerror": "shardingtypeerror"},
                    hints=(
                        named(
                            ["ValueError", "TypeError", "AssertionError"],
                            "run it and read the last line of the traceback.",
                        ),
                    ),
                ),
                Exercise(asks="a chapter number", expected=5, rel_tol=0),
            ),
        ),
        2: Exercise(
            asks="(all-reduces executed per step under jit + scan, under shard_map)",
            expected=None,
            kind="tuple",
            why="under jit + scan the all-reduce is in the loop body and runs once per "
            "micro-batch; shard_map all-reduces once, after the loop.",
            parts=(
                Exercise(
                    asks="a count (an integer)",
                    expected=4,
                    rel_tol=0,
                    hints=(
                        equals(
                            1,
                            "the program text holds it once, but it sits in the loop body.",
                            0,
                        ),
                    ),
                ),
                Exercise(
                    asks="a count (an integer)",
                    expected=1,
                    rel_tol=0,
                    hints=(
                        Hint(
                            "shard_map accumulates the micro-batches locally first.",
                            lambda a, e: (_number(a) or 0) > 1,
                        ),
                    ),
                ),
            ),
        ),
        3: Exercise(
            asks="a function that runs your fixed snippet, taking no arguments",
            expected=_runs,
            kind="callable",
            why="your fixed snippet runs. Compare its output with what the post claims.",
        ),
    }
