"""What the planning package's tests share: the recipe's modules (jaxdist_lm/), the sweep's
benchmark, one request, and two helpers."""

import contextlib
import io
import pathlib
import sys
from types import SimpleNamespace

from jaxdist_lessons.planning import cli, layouts
from jaxdist_lm import layout, train
from jaxdist_lm import model as model_lib  # noqa: F401  (the tests' name for the recipe's model.py)

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import plan_check  # noqa: E402, F401

CHECKED_JSON = ROOT / "book" / "data" / "plan_check.json"
EXAMPLE = [
    "--model",
    "125m",
    "--devices",
    "8",
    "--nodes",
    "2",
    "--chip",
    "h100",
    "--seq-len",
    "2048",
    "--global-batch",
    "16",
]
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


def assert_the_recipe_takes(flags: str) -> None:
    """train.py parses ``flags``, and its layout checks pass for the mesh they name."""
    run = train.parse_args(flags.split())
    sizes = dict.fromkeys(layout.AXES, 1)
    sizes.update((a, int(n)) for a, n in (i.split("=") for i in run.mesh.split(",")))
    layout.check_fits(train.model_config_of(run), SimpleNamespace(shape=sizes), run)


def run_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(argv)
    return status, out.getvalue(), err.getvalue()


def fsdp_run(run_flags: list[str]) -> tuple[layouts.Run, layouts.Layout]:
    run = cli.make_run(cli.parse_args(run_flags))
    return run, layouts.Layout.from_flag(f"fsdp={run.devices}", strategy="FSDP")
