"""traffic: the steps of a ring each collective takes, for the planner's latency."""

from jaxdist_lessons import traffic


def test_ring_steps_per_kind():
    """A gather, a reduce-scatter and an all-to-all take N - 1 steps of a ring, an
    all-reduce both (2 (N - 1)), a permute one; the calls default to one."""
    steps = {
        kind: traffic.ring_steps(traffic.Transfer(kind, 1.0, 8))
        for kind in ("all-gather", "reduce-scatter", "all-to-all", "all-reduce")
    }
    assert steps == {
        "all-gather": 7,
        "reduce-scatter": 7,
        "all-to-all": 7,
        "all-reduce": 14,
    }
    permute = traffic.Transfer("collective-permute", 1.0, None)
    assert traffic.ring_steps(permute) == 1 and permute.calls == 1
