"""The exercises of ``book/08_multi_host.md``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from jaxdist_lessons.exercises.checking import (
    BYTES_NOT_GB,
    Exercise,
    Hint,
    _close,
    _number,
    equals,
    factor,
    named,
)


def _demo_all_reduce_bytes(n: int) -> tuple[int, int]:
    """(bytes the demo's data-parallel step all-reduces, its parameters' bytes) on ``n`` devices."""
    import jax
    import optax
    from jax.sharding import AxisType

    from jaxdist_lessons import comms, data, multihost_demo, train

    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    tx = optax.adam(3e-3)
    shape = multihost_demo.IMAGE_SHAPE
    no_rules = train.rule_shardings(mesh, [])
    state = train.create_train_state(
        multihost_demo.MODEL, tx, shape, no_rules, abstract=True
    )
    step, _ = train.make_steps(train.shardings_of(state), mesh)
    source = data.digits_source("train")
    batch = next(
        data.batches(source, 4 * n, mesh, preprocess=multihost_demo.PREPROCESS)
    )
    text = step.lower(state, batch).compile().as_text()
    return comms.total_bytes(text, "all-reduce"), comms.data_parallel_bytes(
        state.params
    )


def exercises(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    from jaxdist_lessons import comms

    n, links = ctx["n"], ctx["links"]
    reduced, params = _demo_all_reduce_bytes(n)
    ici, dcn = links.values()
    sent = comms.ring_all_reduce_bytes(100e6, 64)
    seconds = (
        factor(
            0.5,
            "a ring all-reduce sends 2 (N-1)/N of the data from each chip, not half.",
        ),
        factor(1e3, "give seconds, not milliseconds."),
        factor(8, "the DCN figure is in bits per second: 8 bits to a byte."),
        factor(1 / 8, "the DCN figure is in bits per second: 8 bits to a byte."),
    )
    return {
        1: Exercise(
            asks='"yes" or "no"',
            expected="yes",
            kind="name",
            why="each global batch holds the same rows wherever they are loaded, so the "
            "steps, and the losses, are the same.",
            hints=(
                named(
                    ["no"],
                    "run both: the global batches hold the same rows whichever process loads "
                    "them.",
                ),
            ),
        ),
        2: Exercise(
            asks="the bytes the step all-reduces (a number)",
            expected=reduced,
            unit="bytes",
            rel_tol=0.001,
            why="one gradient per parameter, plus the BatchNorm statistics averaged over the "
            "devices and the loss.",
            hints=(
                equals(
                    params,
                    "that is the gradients alone: what else does a BatchNorm model average "
                    "over the devices?",
                    0.0001,
                )
                if params != reduced
                else equals(math.nan, ""),
                Hint(
                    "that is what each device sends in a ring; the question asks the bytes "
                    "the all-reduce reduces, its operand.",
                    lambda a, e: (
                        _close(_number(a) or 0, comms.ring_all_reduce_bytes(e, n), 0.01)
                        and n > 1
                    ),
                ),
                *BYTES_NOT_GB,
            ),
        ),
        3: Exercise(
            asks="(seconds on ICI, seconds on DCN, bytes at which DCN takes as long as ICI "
            "for 100 MB)",
            expected=None,
            kind="tuple",
            why="each chip sends 2 (N-1)/N of the data, and the time is bytes over bandwidth; "
            "DCN is slower by the ratio of the bandwidths, so it matches with that much less "
            "data.",
            parts=(
                Exercise(
                    asks="seconds (a number)",
                    expected=sent / ici,
                    unit="seconds",
                    hints=seconds,
                ),
                Exercise(
                    asks="seconds (a number)",
                    expected=sent / dcn,
                    unit="seconds",
                    hints=seconds,
                ),
                Exercise(
                    asks="bytes (a number)",
                    expected=100e6 * dcn / ici,
                    unit="bytes",
                    hints=(
                        equals(
                            100e6 * ici / dcn,
                            "DCN is the slower link: it needs less data.",
                        ),
                        *BYTES_NOT_GB,
                    ),
                ),
            ),
        ),
    }
