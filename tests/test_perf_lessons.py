"""benchmarks/perf_lessons.py: chapter 6's lessons on one device, at a tiny size."""

from by_path import load

perf_lessons = load("perf_lessons", "benchmarks/perf_lessons.py")


def test_donation_aliases_the_whole_state_and_bf16_halves_the_weights():
    tiny = perf_lessons.SIZES["tiny"]
    base = perf_lessons.measure_step(tiny, {}, calls=1)
    kept = perf_lessons.measure_step(tiny, {"donate": False}, calls=1)
    halved = perf_lessons.measure_step(tiny, {"dtype": "bf16 everything"}, calls=1)
    tokens = 4 * tiny.batch * (tiny.seq_len + 1)  # int32
    state = base["argument_bytes"] - tokens  # weights, Adam's two moments and count
    assert state == 3 * 4 * base["parameters"] + 4
    assert base["alias_bytes"] == state and kept["alias_bytes"] == 0
    assert kept["live_bytes"] - base["live_bytes"] == state - (
        base["temp_bytes"] - kept["temp_bytes"]
    )
    assert halved["argument_bytes"] - tokens == 3 * 2 * base["parameters"] + 4
    assert base["loss"] == kept["loss"]  # the same step, donated or not


def test_table_compares_with_the_baseline_measured_last():
    row = lambda name, temp, ms: {
        "lesson": "remat" if name != "base" else "baseline",
        "variant": name,
        "temp_bytes": temp,
        "live_bytes": temp,
        "step_seconds": ms / 1e3,
        "mfu": None,
    }
    report = {
        "sizes": {
            "tiny": {
                "shape": {},
                "steps": [
                    row("base", 4e6, 9),
                    row("full", 2e6, 3),
                    row("base", 4e6, 2),
                ],
                "attention": [
                    {"kind": "splash", "length": 8, "status": "TPU only"},
                ],
            }
        }
    }
    lines = perf_lessons.table(report, "tiny").splitlines()
    assert "| remat | full | 2.0 | 2.0 | 0.50 | 3.00 | 1.50 |  |" in lines
    assert "| splash | 8 | TPU only | |" in lines
