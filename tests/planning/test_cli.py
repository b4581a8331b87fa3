"""planning.cli: the command line and the page's JSON, one-line errors, a shape given by flags, no JAX or NumPy."""

import json
import subprocess
import sys

import pytest
from planning_helpers import (
    EXAMPLE,
    ROOT,
    assert_the_recipe_takes,
    run_main,
)

from jaxdist_lessons.planning import cli, footprint, ranking
from jaxdist_lm import model_config


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--devices", "12", "--nodes", "5"],
            "--devices 12 do not divide into --nodes 5",
        ),
        (["--chip", "v100"], "unknown chip 'v100'; known: a100, a100-40gb, h100"),
        (["--model", "13b"], "unknown model '13b'; presets: tiny, 125m, 1b, 8b, 70b"),
        (["--global-batch", "0"], "--global-batch must be positive, got 0"),
        (["--seq-len", "-8"], "--seq-len must be positive, got -8"),
        (["--devices", "x"], "argument --devices: invalid int value: 'x'"),
        (
            ["--model", "70b", "--devices", "2", "--nodes", "1"],
            "70b fits no layout on 2 x H100 80GB: the smallest needs",
        ),
        (["--model", None, "--layers", "2"], "missing --width --heads --kv-heads"),
        (
            ["--chip", "A100 80GB PCIe"],
            "A100 80GB PCIe has no chip-to-chip bandwidth in hardware.CHIPS",
        ),
        (["--chip", "TPU v6e"], "TPU v6e has no network bandwidth in hardware.CHIPS"),
        (["--devices", "131072"], "--devices 131072: the planner plans up to 65,536"),
        (
            ["--chip", "v5p", "--dtype", "float32"],
            "TPU v5p has no float32 peak in hardware.CHIPS",
        ),
        (
            ["--model", "8b", "--devices", "6", "--nodes", "1", "--global-batch", "7"],
            "no layout splits 8b on 6 devices: --global-batch 7 does not split over data=6",
        ),
        (
            ["--grad-accum", "0"],
            "--grad-accum must be a positive integer or auto, got 0",
        ),
        (
            ["--efficiency", "1.5"],
            "--efficiency 1.5: a fraction of the peak, in (0, 1]",
        ),
        (["--remat", "some"], "argument --remat: invalid choice: 'some'"),
    ],
)
def test_bad_input_gives_one_line_and_status_2(argv, message):
    args = dict(zip(EXAMPLE[::2], EXAMPLE[1::2]))
    args.update(zip(argv[::2], argv[1::2]))
    flat = [x for k, v in args.items() if v is not None for x in (k, v)]
    status, printed, error = run_main(flat)
    assert (status, printed) == (2, "")
    assert error.startswith("plan: ") and error.count("\n") == 1, error
    assert message in error


def test_command_line_exits_2_without_a_traceback():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxdist_lessons.planning",
            *EXAMPLE[:-2],
            "--global-batch",
            "-1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr == "plan: --global-batch must be positive, got -1\n"


def test_a_model_given_by_its_shape(tmp_path, monkeypatch):
    """GQA and experts from flags: the experts' rows appear, each with --model-config;
    --write-config writes the config.json that train.py reads into this shape, the flags
    name it and the recipe takes them; --check compiles them with a config of its own."""
    shape = [
        "--layers",
        "4",
        "--width",
        "512",
        "--heads",
        "8",
        "--kv-heads",
        "2",
        "--mlp-width",
        "1024",
        "--vocab",
        "8000",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--devices",
        "8",
        "--nodes",
        "2",
        "--global-batch",
        "16",
    ]
    status, printed, _ = run_main(shape)
    assert status == 0 and "add --write-config config.json to write it" in printed
    config = tmp_path / "shape.json"
    status, as_json, _ = run_main([*shape, "--json", "--write-config", str(config)])
    assert status == 0
    out = json.loads(as_json)
    assert out["run"]["shape"]["num_kv_heads"] == 2 and out["run"]["model"] == "custom"
    experts = [r["mesh"] for r in out["rows"] if r["strategy"] == "experts"]
    assert sorted(experts) == ["fsdp=2,expert=4", "fsdp=4,expert=2"]
    recipe = model_config.config_from_hf(str(config))
    assert (
        recipe.num_layers,
        recipe.width,
        recipe.num_kv_heads,
        recipe.vocab_size,
    ) == (
        4,
        512,
        2,
        8000,
    )
    for r in filter(lambda r: r["runnable"], out["rows"]):
        assert r["flags"].startswith(f"--model-config {config} ")
        assert_the_recipe_takes(r["flags"])
    asked = []

    def compiled(devices, flag_lines, progress=True):
        asked.extend(flag_lines)
        path = flag_lines[0].split()[1]
        assert model_config.config_from_hf(path) == recipe
        return [
            {"arguments": 1, "temporaries": 1, "collectives": {}} for _ in flag_lines
        ]

    monkeypatch.setattr(cli, "compile_flags", compiled)
    status, _, _ = run_main([*shape, "--check", "--check-rows", "2"])
    assert status == 0 and len(asked) == 2
    status, _, error = run_main([*shape[:-2], "--global-batch", "16", "--heads", "0"])
    assert status == 2 and error == "plan: the model's sizes must be positive\n"


def test_the_planner_imports_without_jax_or_numpy():
    """The "Plan your run" page runs the planning package in Pyodide, which has neither: its
    modules, and the recipe's that they import (jaxdist_lm/model_config.py, ...), are
    standard library only, and they are the ones _ext/planner.py ships with the page (paths
    under the repository's root: jaxdist_lessons/planning/cli)."""
    program = (
        "import pathlib, sys\nfor name in ('jax', 'jaxlib', 'numpy', 'flax', 'optax'):\n"
        "    sys.modules[name] = None  # importing it raises ImportError\n"
        "from jaxdist_lessons.planning import cli\n"
        "print(cli.page_json(['--model', 'tiny', '--devices', '4', '--global-batch', '8'])[:9])\n"
        "root = pathlib.Path(sys.modules['jaxdist_lessons'].__file__).parents[1]\n"
        "print(' '.join(sorted(str(pathlib.Path(m.__file__).relative_to(root).with_suffix(''))"
        " for n, m in list(sys.modules.items())"
        " if n.split('.')[0] in ('jaxdist_lessons', 'jaxdist_lm'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", program],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    shown, modules = done.stdout.splitlines()
    assert shown == '{"run": {'
    sys.path.insert(0, str(ROOT / "_ext"))
    import planner

    assert "jaxdist_lm/model_config" in modules.split()
    assert modules.split() == planner.planner_modules()


def test_page_json_is_the_tables_cells_or_the_error_line():
    """What the page draws: the table as the command line prints it, the rows, or main's line."""
    shown = json.loads(cli.page_json(EXAMPLE))
    run = cli.make_run(cli.parse_args(EXAMPLE))
    rows = ranking.plan(run)
    table = ranking.table(run, rows)
    assert (shown["title"], shown["headers"], shown["cells"]) == (
        table.title,
        table.headers,
        table.rows,
    )
    assert shown["rows"] == json.loads(json.dumps(rows))
    assert shown["usable_bytes"] == footprint.USABLE * run.chip.memory_bytes
    bad = [*EXAMPLE[:-1], "0"]
    assert json.loads(cli.page_json(bad)) == {"error": run_main(bad)[2].strip()}


def test_a_head_dim_of_its_own_and_tied_embeddings():
    """MaxText's shapes give heads that do not add up to the width: --head-dim sets
    them; --tie-embeddings drops the output projection. Both reach the parameters."""
    sizes = {"layers": 4, "width": 1000, "heads": 12, "kv-heads": 4, "mlp-width": 4000}
    sizes |= {"vocab": 32000, "devices": 8, "global-batch": 16}
    shape = [x for flag, n in sizes.items() for x in (f"--{flag}", str(n))]
    assert cli.main(shape) == 2  # 12 heads do not split a width of 1,000
    planned = lambda *flags: cli.model_shape(cli.parse_args([*shape, *flags]))
    a128, a100 = planned("--head-dim", "128"), planned("--head-dim", "100")
    tied = planned("--head-dim", "100", "--tie-embeddings")
    assert (a128.head_width, a100.head_width, a100.tie_embeddings) == (128, 100, False)
    # per unit of a head's width: each layer's q and out (12 heads), k and v (4)
    attention = 4 * 1000 * (2 * 12 + 2 * 4)
    count = model_config.count_params
    assert count(a128) - count(a100) == attention * (128 - 100)
    assert count(a100) - count(tied) == 32000 * 1000  # the output projection
    assert cli.main([*shape, "--head-dim", "128"]) == 0


def test_a_tpus_slices_are_its_nodes():
    """--slices is --nodes's name for a TPU: the same plan, titled in slices; a GPU's
    cluster, a second count or a count below one are refused in one line."""
    request = ["--model", "8b", "--devices", "512", "--chip", "v5p"]
    request += ["--global-batch", "512", "--seq-len", "2048"]
    slices = json.loads(cli.page_json([*request, "--slices", "2"]))
    nodes = json.loads(cli.page_json([*request, "--nodes", "2"]))
    assert slices == nodes and "(2 slices)" in slices["title"]
    for extra, message in [
        (["--slices", "2", "--nodes", "2"], "--slices and --nodes say the same thing"),
        (["--slices", "0"], "--slices must be positive, got 0"),
    ]:
        assert json.loads(cli.page_json([*request, *extra]))["error"].startswith(
            f"plan: {message}"
        )
    gpu = ["--model", "8b", "--devices", "16", "--global-batch", "32"]
    error = json.loads(cli.page_json([*gpu, "--slices", "2"]))["error"]
    assert error == "plan: --slices 2: slices are a TPU's; a GPU cluster has --nodes"
