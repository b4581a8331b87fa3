"""The profile figure draws one row per device and separates compute from collectives."""

import matplotlib.pyplot as plt
import pytest

from jaxdist_lessons import plots
from jaxdist_lessons.profiling import OpEvent


def test_profile_timeline_draws_each_kind_per_device():
    events = [OpEvent("dot.1", "jit_step", d, 10.0 * d, 5.0) for d in range(3)]
    events += [OpEvent("all-reduce", "jit_step", d, 20.0, 7.0) for d in range(3)]
    fig = plots.profile_timeline(events, title="three devices")
    line_ax, bar_ax = fig.axes
    assert line_ax.get_title() == "three devices"
    assert [t.get_text() for t in line_ax.get_yticklabels()] == ["0", "1", "2"]
    assert len(line_ax.collections) == 6  # one broken bar per device and kind
    widths = [p.get_width() for p in bar_ax.patches]
    assert widths == pytest.approx([0.005] * 3 + [0.007] * 3)  # milliseconds
    plt.close(fig)


def test_profile_timeline_needs_events():
    with pytest.raises(ValueError, match="at least one event"):
        plots.profile_timeline([])
