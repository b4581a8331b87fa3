"""planning.checking: the predictions against the compiler (book/data/plan_check.json, from
benchmarks/plan_check.py; rows recompiled live)."""

import json
import os
import subprocess
import sys

import pytest
from planning_helpers import (
    CHECKED_JSON,
    EXAMPLE,
    ROOT,
    plan_check,
    run_main,
)

from jaxdist_lessons.planning import (
    checking,
    cli,
    layouts,
    ranking,
    xla_cpu,
)
from jaxdist_lm import compiled as lm_compiled


def test_the_sweep_agrees_with_the_compiler():
    """>= 20 layouts compiled (benchmarks/plan_check.py): the predicted argument bytes and the
    bytes of every collective kind that carries 1% of the program's bytes or more, within 10%;
    and the JSON's predictions are the planner's today (rerun the benchmark with --reuse if
    the planner changed, without it if the recipe did)."""
    checked = json.loads(CHECKED_JSON.read_text())
    rows = checked["rows"]
    assert len(rows) >= 20 and checked["summary"]["all_agree"]
    assert {r["devices"] for r in rows} >= {6, 8, 12, 16}
    assert {"DP", "FSDP", "HSDP", "FSDP+TP", "sequence", "experts"} <= {
        r["strategy"] for r in rows
    }
    kinds = {
        k for r in rows for k, v in r["check"]["collectives"].items() if not v["minor"]
    }
    assert {"all-gather", "all-reduce", "all-to-all", "collective-permute"} <= kinds
    regimes = set()
    for r in rows:
        run, predicted = plan_check.prediction(tuple(r["combo"]))
        regimes.add(
            xla_cpu.gathers_the_table(
                run, layouts.Layout.from_flag(r["mesh"], strategy="")
            )
        )
        check = checking.compare(predicted, r["compiled"])
        assert check == r["check"], r["mesh"]
        assert checking.agrees(check), (r["model"], r["mesh"], check)
    assert regimes == {True, False}  # both ways of compiling the embedding lookup
    assert sorted(plan_check.key(r["combo"]) for r in rows) == sorted(
        plan_check.key(list(c)) for c in plan_check.COMBOS
    )


def test_two_rows_recompile_to_the_jsons_values(tmp_path):
    """The JSON is current: one tiny row compiled again by the planner's worker (exact bytes),
    and one through train.py's own --compile-only with the flags the planner prints (they run
    as given; its line prints GB to 3 decimals and collective bytes exactly)."""
    checked = json.loads(CHECKED_JSON.read_text())
    rows = {(r["model"], r["devices"], r["mesh"]): r for r in checked["rows"]}
    fsdp = rows[("tiny", 8, "fsdp=8")]
    [compiled] = checking.compile_flags(8, [fsdp["flags"]], progress=False)
    assert compiled == fsdp["compiled"]
    ring = rows[("tiny", 8, "fsdp=2,sequence=4")]
    # The tests' XLA flags (conftest.py: backend level 0) compile it faster; the
    # buffers and collectives it prints are those of the default level.
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
    }
    done = subprocess.run(
        [
            sys.executable,
            *("-m", "jaxdist_lm.train"),
            *ring["flags"].split(),
            "--num-devices",
            "8",
            "--compile-only",
            "--compilation-cache",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    printed = lm_compiled.read_summary(done.stdout)
    assert printed["arguments"] == round(ring["compiled"]["arguments"] / 1e9, 3)
    assert printed["collectives"] == ring["compiled"]["collectives"]


def test_check_prints_predicted_and_compiled_side_by_side(monkeypatch):
    """--check's table and JSON, with the compiler stood in for (the recompile test above
    runs the real one): compiled values of 90% of the predicted give ratios of 1.111."""
    asked = []

    def compiled(devices, flag_lines, progress=True):
        asked.append((devices, list(flag_lines)))
        rows = {
            r["flags"]: r for r in ranking.plan(cli.make_run(cli.parse_args(EXAMPLE)))
        }
        return [
            {
                "arguments": rows[f]["arguments_bytes"] * 0.9,
                "temporaries": 1e9,
                "collectives": {
                    k: v * 0.9 for k, v in rows[f]["collective_bytes"].items()
                },
            }
            for f in flag_lines
        ]

    monkeypatch.setattr(cli, "compile_flags", compiled)
    status, printed, _ = run_main([*EXAMPLE, "--check", "--check-rows", "2"])
    assert status == 0
    [(devices, flags)] = asked
    assert devices == 8 and len(flags) == 2 and "n/a" not in flags
    assert printed.count(" 1.111") >= 4  # arguments and at least one kind, for each row
    status, as_json, _ = run_main([*EXAMPLE, "--check", "--check-rows", "2", "--json"])
    checks = json.loads(as_json)["checks"]
    assert [c["arguments"]["ratio"] for c in checks] == pytest.approx([1 / 0.9] * 2)
