"""plan: the planner's models match the recipe's, its command line, and its predictions against
the compiler (book/data/plan_check.json, from benchmarks/plan_check.py; three rows recompiled)."""

import contextlib
import dataclasses
import io
import json
import os
import pathlib
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from jaxdist_lessons import plan

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "lm"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import layout  # noqa: E402
import model as model_lib  # noqa: E402
import plan_check  # noqa: E402
import train  # noqa: E402

CHECKED_JSON = ROOT / "book" / "data" / "plan_check.json"
EXAMPLE = ["--model", "125m", "--devices", "8", "--nodes", "2", "--chip", "h100",
           "--seq-len", "2048", "--global-batch", "16"]  # fmt: skip


def assert_the_recipe_takes(flags: str) -> None:
    """train.py parses ``flags``, and its layout checks pass for the mesh they name."""
    args = train.parse_args(flags.split())
    sizes = dict.fromkeys(layout.AXES, 1)
    sizes.update((a, int(n)) for a, n in (i.split("=") for i in args.mesh.split(",")))
    layout.check_fits(train.model_config(args), SimpleNamespace(shape=sizes), args)


def run_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = plan.main(argv)
    return status, out.getvalue(), err.getvalue()


def test_presets_params_and_flops_are_the_recipes():
    assert plan.PRESETS.keys() == model_lib.PRESETS.keys()
    for name, shape in plan.PRESETS.items():
        recipe = model_lib.PRESETS[name]
        for field in dataclasses.fields(shape):
            assert getattr(shape, field.name) == getattr(recipe, field.name), (
                name,
                field,
            )
        for experts in ({}, {"num_experts": 8, "top_k": 2}):
            ours = dataclasses.replace(shape, **experts)
            theirs = dataclasses.replace(recipe, **experts)
            assert plan.param_count(ours) == model_lib.count_params(theirs)
            assert plan.model_flops_per_token(ours, 4096) == model_lib.flops_per_token(
                theirs, 4096
            )
            weights = sum(plan.math.prod(dims) for dims, _ in plan.weight_shapes(ours))
            assert weights == plan.param_count(ours)


def test_json_has_the_tables_rows():
    status, printed, _ = run_main(EXAMPLE)
    assert status == 0
    status, as_json, _ = run_main([*EXAMPLE, "--json"])
    assert status == 0
    rows = json.loads(as_json)["rows"]
    lines = printed.splitlines()
    table_rows = lines[3 : 3 + len(rows)]  # title, headers, rule, then one line a row
    assert len(rows) >= 8 and not lines[3 + len(rows)].strip()
    for line, r in zip(table_rows, rows):
        cells = re.split(r"\s{2,}", line.strip())
        assert cells[:3] == [r["strategy"], r["mesh"], "yes" if r["fits"] else "no"]
        assert cells[3] == str(r["grad_accum"] or "pipeline")
        assert float(cells[8]) == pytest.approx(
            r["memory_bytes"]["total"] / 1e9, rel=1e-3
        )
        assert cells[-1] == f"{r['mfu']:.1%}"
    strategies = {r["strategy"] for r in rows}
    assert {
        "DP",
        "ZeRO-1",
        "FSDP",
        "HSDP",
        "FSDP+TP",
        "sequence",
        "pipeline 1F1B",
    } <= strategies
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True)  # fitting rows first
    for r in rows:  # each printed flag line is the row's, and the recipe takes it
        assert f"{r['strategy']:<22} {r['flags']}" in printed
        if not r["runnable"]:
            assert r["flags"] == plan.NEEDS[r["strategy"]]
            continue
        assert_the_recipe_takes(r["flags"])
        assert ("--zero1" in r["flags"]) == (r["strategy"] == "ZeRO-1")
        if "pipeline" in r["strategy"]:  # the recipe's flags for its schedule
            schedule = r["strategy"].split()[1].lower()
            assert f"--schedule {schedule}" in r["flags"], r
            assert "--mesh pipeline=" in r["flags"] and "--grad-accum " in r["flags"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "12", "--nodes", "5"], "--devices 12 do not divide into --nodes 5"),
        (["--chip", "v100"], "unknown chip 'v100'; known: a100, a100-40gb, h100"),
        (["--model", "13b"], "unknown model '13b'; presets: tiny, 125m, 1b, 8b, 70b"),
        (["--global-batch", "0"], "--global-batch must be positive, got 0"),
        (["--seq-len", "-8"], "--seq-len must be positive, got -8"),
        (["--devices", "x"], "argument --devices: invalid int value: 'x'"),
        (["--model", "70b", "--devices", "2", "--nodes", "1"],
         "70b fits no layout on 2 x H100 80GB: the smallest needs"),
        (["--model", None, "--layers", "2"], "missing --width --heads --kv-heads"),
        (["--chip", "TPU v4"], "TPU v4 has no chip-to-chip bandwidth in hardware.CHIPS"),
        (["--chip", "TPU v5e"], "TPU v5e has no network bandwidth in hardware.CHIPS"),
        (["--devices", "131072"], "--devices 131072: the planner plans up to 65,536"),
        (["--chip", "v5p", "--dtype", "float32"],
         "TPU v5p has no float32 peak in hardware.CHIPS"),
        (["--model", "8b", "--devices", "6", "--nodes", "1", "--global-batch", "7"],
         "no layout splits 8b on 6 devices: global batch 7 does not split over 6"),
        (["--grad-accum", "0"], "--grad-accum must be a positive integer or auto, got 0"),
        (["--efficiency", "1.5"], "--efficiency 1.5: a fraction of the peak, in (0, 1]"),
        (["--remat", "some"], "argument --remat: invalid choice: 'some'"),
    ],
)  # fmt: skip
def test_bad_input_gives_one_line_and_status_2(argv, message):
    args = dict(zip(EXAMPLE[::2], EXAMPLE[1::2]))
    args.update(zip(argv[::2], argv[1::2]))
    flat = [x for k, v in args.items() if v is not None for x in (k, v)]
    status, printed, error = run_main(flat)
    assert (status, printed) == (2, "")
    assert error.startswith("plan: ") and error.count("\n") == 1, error
    assert message in error


def test_command_line_exits_2_without_a_traceback():
    done = subprocess.run([sys.executable, "-m", "jaxdist_lessons.plan", *EXAMPLE[:-2],
                           "--global-batch", "-1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == "plan: --global-batch must be positive, got -1\n"


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
            plan.gathers_the_table(run, plan.Candidate("", plan.mesh_sizes(r["mesh"])))
        )
        check = plan.compare(predicted, r["compiled"])
        assert check == r["check"], r["mesh"]
        assert plan.agrees(check), (r["model"], r["mesh"], check)
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
    [compiled] = plan.compile_flags(8, [fsdp["flags"]], progress=False)
    assert compiled == fsdp["compiled"]
    ring = rows[("tiny", 8, "fsdp=2,sequence=4")]
    # The tests' XLA flags (tests/conftest.py: backend level 0) compile it faster; the
    # buffers and collectives it prints are those of the default level.
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}  # fmt: skip
    done = subprocess.run([sys.executable, "examples/lm/train.py", *ring["flags"].split(),
                           "--num-devices", "8", "--compile-only", "--compilation-cache",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("per device:"))
    arguments = float(re.search(r"arguments ([\d.]+) GB", line)[1])
    assert arguments == round(ring["compiled"]["arguments"] / 1e9, 3)
    printed = {k: int(v) for k, v in re.findall(r"([a-z-]+) (\d+) B", line)}
    assert printed == ring["compiled"]["collectives"]


def test_check_prints_predicted_and_compiled_side_by_side(monkeypatch):
    """--check's table and JSON, with the compiler stood in for (the recompile test above
    runs the real one): compiled values of 90% of the predicted give ratios of 1.111."""
    asked = []

    def compiled(devices, flag_lines, progress=True):
        asked.append((devices, list(flag_lines)))
        rows = {
            r["flags"]: r for r in plan.plan(plan.make_run(plan.parse_args(EXAMPLE)))
        }
        return [{"arguments": rows[f]["arguments_bytes"] * 0.9, "temporaries": 1e9,
                 "collectives": {k: v * 0.9 for k, v in rows[f]["collective_bytes"].items()}}
                for f in flag_lines]  # fmt: skip

    monkeypatch.setattr(plan, "compile_flags", compiled)
    status, printed, _ = run_main([*EXAMPLE, "--check", "--check-rows", "2"])
    assert status == 0
    [(devices, flags)] = asked
    assert devices == 8 and len(flags) == 2 and "n/a" not in flags
    assert printed.count(" 1.111") >= 4  # arguments and at least one kind, for each row
    status, as_json, _ = run_main([*EXAMPLE, "--check", "--check-rows", "2", "--json"])
    checks = json.loads(as_json)["checks"]
    assert [c["arguments"]["ratio"] for c in checks] == pytest.approx([1 / 0.9] * 2)


def test_a_model_given_by_its_shape(tmp_path, monkeypatch):
    """GQA and experts from flags: the experts' rows appear, each with --model-config;
    --write-config writes the config.json that train.py reads into this shape, the flags
    name it and the recipe takes them; --check compiles them with a config of its own."""
    shape = ["--layers", "4", "--width", "512", "--heads", "8", "--kv-heads", "2",
             "--mlp-width", "1024", "--vocab", "8000", "--experts", "8", "--top-k", "2",
             "--devices", "8", "--nodes", "2", "--global-batch", "16"]  # fmt: skip
    status, printed, _ = run_main(shape)
    assert status == 0 and "add --write-config config.json to write it" in printed
    config = tmp_path / "shape.json"
    status, as_json, _ = run_main([*shape, "--json", "--write-config", str(config)])
    assert status == 0
    out = json.loads(as_json)
    assert out["run"]["shape"]["num_kv_heads"] == 2 and out["run"]["model"] == "custom"
    experts = [r["mesh"] for r in out["rows"] if r["strategy"] == "experts"]
    assert sorted(experts) == ["fsdp=2,expert=4", "fsdp=4,expert=2"]
    recipe = model_lib.config_from_hf(str(config))
    assert (recipe.num_layers, recipe.width, recipe.num_kv_heads, recipe.vocab_size) == (
        4, 512, 2, 8000,
    )  # fmt: skip
    for r in filter(lambda r: r["runnable"], out["rows"]):
        assert r["flags"].startswith(f"--model-config {config} ")
        assert_the_recipe_takes(r["flags"])
    asked = []

    def compiled(devices, flag_lines, progress=True):
        asked.extend(flag_lines)
        path = flag_lines[0].split()[1]
        assert model_lib.config_from_hf(path) == recipe
        return [
            {"arguments": 1, "temporaries": 1, "collectives": {}} for _ in flag_lines
        ]

    monkeypatch.setattr(plan, "compile_flags", compiled)
    status, _, _ = run_main([*shape, "--check", "--check-rows", "2"])
    assert status == 0 and len(asked) == 2
    status, _, error = run_main([*shape[:-2], "--global-batch", "16", "--heads", "0"])
    assert status == 2 and error == "plan: the model's sizes must be positive\n"


def test_the_planner_imports_without_jax_or_numpy():
    """The "Plan your run" page runs plan.py in Pyodide, which has neither: its modules are
    standard library only, and they are the ones _ext/planner.py ships with the page."""
    program = ("import sys\nfor name in ('jax', 'jaxlib', 'numpy', 'flax', 'optax'):\n"
               "    sys.modules[name] = None  # importing it raises ImportError\n"
               "from jaxdist_lessons import plan\n"
               "print(plan.page_json(['--model', 'tiny', '--devices', '4', '--global-batch', '8'])[:9])\n"
               "print(' '.join(sorted(m.split('.')[-1] for m in sys.modules"
               " if m.startswith('jaxdist_lessons.'))))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)  # fmt: skip
    shown, modules = done.stdout.splitlines()
    assert shown == '{"run": {'
    sys.path.insert(0, str(ROOT / "_ext"))
    import planner

    assert ["__init__", *modules.split()] == planner.planner_modules()


def test_page_json_is_the_tables_cells_or_the_error_line():
    """What the page draws: the table as the command line prints it, the rows, or main's line."""
    shown = json.loads(plan.page_json(EXAMPLE))
    run = plan.make_run(plan.parse_args(EXAMPLE))
    rows = plan.plan(run)
    table = plan.table(run, rows)
    assert (shown["title"], shown["headers"], shown["cells"]) == (
        table.title,
        table.headers,
        table.rows,
    )
    assert shown["rows"] == json.loads(json.dumps(rows))
    assert shown["usable_bytes"] == plan.USABLE * run.chip.memory_bytes
    bad = [*EXAMPLE[:-1], "0"]
    assert json.loads(plan.page_json(bad)) == {"error": run_main(bad)[2].strip()}


@pytest.mark.parametrize(
    "request_",
    [["--model", "70b", "--devices", "64", "--nodes", "8", "--chip", "h100",
      "--seq-len", "4096", "--global-batch", "256"],
     ["--model", "8b", "--devices", "16", "--nodes", "2", "--chip", "h100",
      "--seq-len", "8192", "--global-batch", "32"],
     ["--model", "1b", "--experts", "8", "--top-k", "2", "--devices", "8",
      "--chip", "a100", "--seq-len", "2048", "--global-batch", "32"]],
)  # fmt: skip
def test_every_ranked_row_has_flags_the_recipe_takes(request_):
    """Pipelines (with their schedule and micro-batches, tensor parallelism inside the
    stages), ZeRO-1, host offload and dropless experts included; the one the recipe does
    not run (ZeRO-2) says what it needs, and ranks after every runnable row that fits."""
    status, as_json, _ = run_main([*request_, "--json"])
    assert status == 0
    rows = json.loads(as_json)["rows"]
    strategies = {r["strategy"] for r in rows}
    assert {
        "pipeline 1F1B",
        "pipeline 1F1B + TP",
        "FSDP + offload",
        "ZeRO-2",
    } <= strategies
    if "--experts" in request_:
        assert "experts dropless" in strategies
    order = [(not r["fits"], not r["runnable"]) for r in rows]
    assert order == sorted(order)
    for r in rows:
        if r["strategy"] == "ZeRO-2":
            assert not r["runnable"] and r["flags"].startswith("needs: ZeRO-2")
            continue
        assert_the_recipe_takes(r["flags"])
        assert ("--offload optimizer,activations" in r["flags"]) == (
            r["strategy"] == "FSDP + offload"
        )
        assert ("--dispatch dropless" in r["flags"]) == ("dropless" in r["strategy"])


def _fsdp(run_flags: list[str]) -> tuple[plan.Run, plan.Candidate]:
    run = plan.make_run(plan.parse_args(run_flags))
    return run, plan.Candidate("FSDP", plan.mesh_sizes(f"fsdp={run.devices}"))


GPU_8B = [
    "--model",
    "8b",
    "--devices",
    "8",
    "--seq-len",
    "4096",
    "--global-batch",
    "16",
]


def test_fsdp_on_a_gpu_sends_three_bf16_copies_of_the_weights_less_one_table():
    """Gathers in the forward and the backward, a reduce-scatter of the gradient, in
    bfloat16; the embedding table is gathered once (the lookup), never in the backward:
    (n-1)/n x 2 bytes x (3 P - V D) a device, a micro-batch; XLA:CPU's are float32."""
    run, fsdp = _fsdp(GPU_8B)
    P, V, D = plan.param_count(run.shape), run.shape.vocab_size, run.shape.width  # noqa: N806
    overlapped, exposed = plan.gpu_transfers(run, fsdp)
    assert exposed == [] and {m.kind for m in overlapped} == {
        "all-gather",
        "reduce-scatter",
    }
    sent = sum(plan.sent_bytes(m) for m in overlapped)
    assert sent == pytest.approx(7 / 8 * 2 * (3 * P - V * D), rel=1e-12)
    twice = dataclasses.replace(run, grad_accum=2)
    again = sum(plan.sent_bytes(m) for m in plan.gpu_transfers(twice, fsdp)[0])
    assert again == pytest.approx(2 * sent, rel=1e-12)  # gathered each micro-batch
    cpu = dataclasses.replace(run, bytes="xla-cpu")
    assert plan.priced_transfers(cpu, fsdp)[0] == (
        plan.weight_transfers(run, fsdp) + plan.embedding_transfers(run, fsdp)
    )
    assert {m.bytes for m in plan.weight_transfers(run, fsdp)} != {
        m.bytes for m in overlapped
    }


def test_overlap_hides_fsdps_collectives_and_waits_for_tensor_parallelisms():
    run, fsdp = _fsdp(GPU_8B)
    t = plan.step_seconds(run, fsdp)
    assert t["exposed"] == 0 and t["step"] == max(t["compute"], t["overlapped"])
    tp = plan.Candidate("FSDP+TP", plan.mesh_sizes("fsdp=4,tensor=2"))
    t = plan.step_seconds(run, tp)
    assert t["exposed"] > 0
    assert t["step"] == pytest.approx(max(t["compute"], t["overlapped"]) + t["exposed"])
    # Megatron's sequence parallelism: 6 all-gathers and 6 reduce-scatters a layer under
    # remat (forward, its recomputation, backward), 4 and 4 without; bf16 activations
    [gather, scatter] = plan.gpu_activation_transfers(run, tp)
    whole = 2 * 4 * 4096 * 4096  # bf16 bytes of (B, T, D): 4 rows a device, 16 over 4
    assert gather.bytes == (6 * 32 + 2) * whole and scatter.bytes == gather.bytes / 2
    none = dataclasses.replace(run, remat="none")
    assert plan.gpu_activation_transfers(none, tp)[0].bytes == (4 * 32 + 2) * whole


def test_remat_trades_memory_for_flops_and_grad_accum_memory_for_nothing():
    run, fsdp = _fsdp(GPU_8B)
    by = {r: dataclasses.replace(run, remat=r) for r in ("none", "dots", "full")}
    kept = [plan.activation_bytes(by[r], fsdp) for r in ("none", "dots", "full")]
    assert kept == sorted(kept, reverse=True) and kept[0] > 3 * kept[2]
    flops = [plan.remat_flops(by[r]) for r in ("none", "dots", "full")]
    assert flops[0] == 1 < flops[1] < flops[2] == 4 / 3
    thirds = dataclasses.replace(run, grad_accum=3)
    assert plan.problems(thirds, fsdp) == [
        "2 sequences a device do not split into --grad-accum 3 micro-batches"
    ]
    halves = dataclasses.replace(run, grad_accum=2)
    assert plan.activation_bytes(halves, fsdp) == pytest.approx(kept[2] / 2)
    assert (
        plan.step_seconds(halves, fsdp)["compute"]
        == plan.step_seconds(run, fsdp)["compute"]
    )
    status, as_json, _ = run_main(
        [*GPU_8B, "--remat", "dots", "--grad-accum", "2", "--json"]
    )
    for r in filter(lambda r: r["runnable"], json.loads(as_json)["rows"]):
        assert_the_recipe_takes(r["flags"])
        assert "--remat dots" in r["flags"] and r["strategy"] != "FSDP + offload"
        assert ("--grad-accum 2" in r["flags"]) == ("pipeline" not in r["strategy"])
        assert r["tokens_per_second_per_device"] == pytest.approx(
            16 * 4096 / r["step_seconds"] / 8
        )
        assert sum(
            v for k, v in r["memory_gb"].items() if k != "total"
        ) == pytest.approx(r["memory_gb"]["total"])


def test_grad_accum_auto_takes_each_layouts_fewest_micro_batches_that_fit():
    """8b on 16 H100s, 256 x 8192 a step: FSDP fits with 2 micro-batches, not 1; ZeRO-2
    (gradients split too) needs fewer than ZeRO-1; tensor parallelism inside a pipeline's
    stages waits on its activations' collectives."""
    argv = ["--model", "8b", "--devices", "16", "--nodes", "2", "--seq-len", "8192",
            "--global-batch", "256"]  # fmt: skip
    rows = {
        (r["strategy"], r["mesh"]): r
        for r in json.loads(run_main([*argv, "--json"])[1])["rows"]
    }
    fsdp = rows[("FSDP", "fsdp=16")]
    assert (
        fsdp["fits"] and fsdp["grad_accum"] == 2 and "--grad-accum 2" in fsdp["flags"]
    )
    run = plan.make_run(plan.parse_args(argv))
    one = dataclasses.replace(run, fit_accum=False)
    assert not plan.row(one, plan.Candidate("FSDP", plan.mesh_sizes("fsdp=16")))["fits"]
    zero1, zero2 = rows[("ZeRO-1", "data=16")], rows[("ZeRO-2", "data=16")]
    assert zero2["grad_accum"] < zero1["grad_accum"]
    assert zero2["memory_bytes"]["optimizer"] == zero1["memory_bytes"]["optimizer"]
    assert zero2["memory_bytes"]["gradients"] < zero1["memory_bytes"]["gradients"] / 10
    staged = rows[("pipeline 1F1B + TP", "pipeline=2,fsdp=4,tensor=2")]
    assert (
        staged["seconds"]["exposed"] > 0
        and "--mesh pipeline=2,fsdp=4,tensor=2" in staged["flags"]
    )
    assert rows[("pipeline 1F1B", "pipeline=2,fsdp=8")]["seconds"]["exposed"] == 0
