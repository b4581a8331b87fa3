"""The first cell of every chapter installs the package on Colab or Kaggle, and only there."""

import fnmatch
import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest

from jaxdist_lessons import colab

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAPTERS = [  # the notebooks' text sources (a plain page, the glossary, has no .ipynb)
    md
    for md in sorted((ROOT / "book").glob("*.md"))
    if md.with_suffix(".ipynb").exists()
]


def first_code_cell(text: str) -> str:
    """The code of the first code cell of a MyST Markdown notebook."""
    match = colab._FIRST_CELL.search(text)
    assert match is not None, "no code cell found"
    return match.group("code")


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_every_chapter_starts_with_the_install_cell(path):
    assert first_code_cell(path.read_text()) == colab.INSTALL_CELL, (
        f"{path.name}: its first cell differs from jaxdist_lessons.colab.INSTALL_CELL; run "
        "`python -m jaxdist_lessons.colab` and `jupytext --sync book/*.md`"
    )
    notebook_cells = json.loads(path.with_suffix(".ipynb").read_text())["cells"]
    first = next(c for c in notebook_cells if c["cell_type"] == "code")
    assert first["metadata"]["tags"] == list(colab.TAGS)


def test_with_install_cell_inserts_once_and_replaces_after():
    chapter = "# Title\n\n```{code-cell}\nfrom jaxdist_lessons import devices\n```\n"
    once = colab.with_install_cell(chapter)
    assert first_code_cell(once) == colab.INSTALL_CELL
    assert colab.with_install_cell(once) == once
    assert once.count("{code-cell}") == 2
    with pytest.raises(ValueError, match="no code cell found"):
        colab.with_install_cell("# no code here\n")


# A fresh runtime: no PYTHONPATH pointing at a checkout of the package.
FRESH = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def run_cell(
    python: str, cwd: pathlib.Path, prelude: str = "", **env: str
) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in FRESH.items() if not k.startswith(("COLAB", "KAGGLE"))}
    return subprocess.run(
        [python, "-c", prelude + colab.INSTALL_CELL],
        cwd=cwd,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_cell_does_nothing_off_colab(tmp_path):
    proc = run_cell(sys.executable, tmp_path)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == ""


NOT_IN_A_WHEEL = (
    ".git",
    ".venv",
    ".ci-venv",
    "_build",
    "build",
    "dist",
    "*.egg-info",
    "book",
)


@pytest.fixture(scope="module")
def colab_like(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    """A fresh venv that sees this environment's packages (JAX included, as on Colab) but not
    jaxdist_lessons, and a wheel of the package uploaded to its working directory."""
    tmp = tmp_path_factory.mktemp("colab")
    wheel_dir = tmp / "content"
    # Built from a copy, so that setuptools' build/ folder is left there, not in the repository.
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_IN_A_WHEEL))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            *no_build_isolation(),
            str(source),
            "-w",
            str(wheel_dir),
        ],
        check=True,
        timeout=600,
    )
    return runtime_venv(tmp / "venv"), wheel_dir


def no_build_isolation() -> list[str]:
    """``--no-build-isolation`` where this environment has the setuptools that
    pyproject.toml's build-system requires: the wheel is built with it, without pip's
    isolated build environment (seconds to set up); elsewhere, nothing."""
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return []
    return ["--no-build-isolation"] if int(version.split(".")[0]) >= 77 else []


def runtime_venv(venv: pathlib.Path) -> pathlib.Path:
    """A venv that sees this environment's packages (JAX and pip included) but not
    jaxdist_lessons. It has no pip of its own (``ensurepip`` takes seconds): ``python -m
    pip`` there runs this environment's pip, which installs into the venv, the interpreter
    that runs it, as Colab's pip installs into Colab's Python."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        check=True,
        timeout=120,
    )
    python = venv / "bin" / "python"
    site = subprocess.run(
        [
            str(python),
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # A path line in a .pth file adds this environment's site-packages but does not run the
    # .pth files inside it, so the editable install of jaxdist_lessons stays invisible.
    pathlib.Path(site, "runtime.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n"
    )
    return python


def python_in(
    python: pathlib.Path, code: str, cwd: pathlib.Path
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), "-c", code], cwd=cwd, env=FRESH, capture_output=True, text=True
    )


def test_on_simulated_colab_without_a_wheel_the_cell_says_what_to_upload(
    colab_like, tmp_path
):
    python, _ = colab_like
    proc = run_cell(str(python), tmp_path, COLAB_RELEASE_TAG="simulated")
    assert "RuntimeError: Upload jaxdist_lessons-*.whl" in proc.stderr


def test_on_simulated_colab_the_cell_installs_the_uploaded_wheel_and_keeps_jax(
    colab_like,
):
    python, content = colab_like
    # Before and after the cell, one fresh process each (each imports JAX once).
    before = python_in(python, SHOW_JAX + TRY_PACKAGE, content)
    assert before.returncode == 0, before.stderr
    jax_before, package = before.stdout.splitlines()
    assert package == "ModuleNotFoundError"
    proc = run_cell(str(python), content, COLAB_RELEASE_TAG="simulated")
    assert proc.returncode == 0, proc.stderr
    after = python_in(python, SHOW_JAX + AFTER_INSTALL, content)
    assert after.returncode == 0, after.stderr
    jax_after, installed, recipe, planner, zigzag = after.stdout.splitlines()
    # the wheel, not the editable copy: both of its packages
    assert str(python.parent.parent) in installed
    assert str(python.parent.parent) in recipe
    assert jax_after == jax_before
    # The planner imports the recipe's model_config.py: the wheel's, the one file.
    assert planner == "True 4096"
    # The recipe's modules ship in the wheel, a top-level package beside jaxdist_lessons.
    assert zigzag == "[0, 1, 6, 7, 2, 3, 4, 5]"
    [wheel] = content.glob("jaxdist_lessons-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    recipe_files = {f"jaxdist_lm/{p.name}" for p in (ROOT / "jaxdist_lm").glob("*.py")}
    assert "jaxdist_lm/train.py" in recipe_files
    assert recipe_files <= names, sorted(recipe_files - names)
    assert not any(n.startswith("jaxdist_lessons/lm/") for n in names)


SHOW_JAX = "import jax; print(jax.__file__, jax.__version__)\n"
TRY_PACKAGE = (
    "try:\n    import jaxdist_lessons\n    print('imported')\n"
    "except ImportError as error:\n    print(type(error).__name__)\n"
)
AFTER_INSTALL = (
    "import jaxdist_lessons; print(jaxdist_lessons.__file__)\n"
    "import jaxdist_lm; print(jaxdist_lm.__file__)\n"
    "from jaxdist_lessons.planning import layouts; "
    "from jaxdist_lm import model_config as m; "
    "print(layouts.ModelConfig is m.ModelConfig, m.PRESETS['8b'].width)\n"
    "from jaxdist_lm import layout; print(layout.zigzag(8, 2).tolist())\n"
)


def test_on_simulated_colab_the_chapter_runs_after_the_cell(colab_like, tmp_path):
    python, content = colab_like
    chapter = ROOT / "book" / "02_device_mesh.ipynb"
    script = textwrap.dedent(f"""
        import nbformat
        from nbclient import NotebookClient
        nb = nbformat.read({str(chapter)!r}, as_version=4)
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={{"metadata": {{"path": {str(content)!r}}}}}).execute()
        print("RAN", len(nb.cells))
    """)
    proc = subprocess.run(
        [str(python), "-c", script],
        capture_output=True,
        text=True,
        timeout=900,
        env={**FRESH, "COLAB_RELEASE_TAG": "simulated", "JAXDIST_NUM_DEVICES": "2"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RAN" in proc.stdout


def old_jax(tmp_path: pathlib.Path, version: str) -> pathlib.Path:
    """A folder that, first on sys.path, makes importlib.metadata report jax ``version``."""
    dist = tmp_path / "old_jax" / f"jax-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: jax\nVersion: {version}\n"
    )
    return dist.parent


def with_device_files(*paths: str) -> str:
    """Code that makes the cell see exactly ``paths`` under /dev (a GPU's, a TPU's, none)."""
    return (
        "import fnmatch, glob, os\n"
        "_exists, _glob = os.path.exists, glob.glob\n"
        f"os.path.exists = lambda p: p in {paths!r} if p.startswith('/dev/') else _exists(p)\n"
        f"glob.glob = lambda p: fnmatch.filter({paths!r}, p) if p.startswith('/dev/') "
        "else _glob(p)\n"
    )


@pytest.mark.parametrize(
    "version, device_files, command",
    [
        ("0.8.0", (), 'pip install -U "jax==0.10.2"'),
        (
            "0.8.0",
            ("/dev/nvidia0", "/dev/nvidiactl"),
            'pip install -U "jax[cuda12]==0.10.2"',
        ),
        ("0.4.38", ("/dev/accel0", "/dev/accel1"), 'pip install -U "jax[tpu]==0.10.2"'),
        (
            "0.9.2",
            ("/dev/vfio/0", "/dev/vfio/vfio"),
            'pip install -U "jax[tpu]==0.10.2"',
        ),
    ],
    ids=["cpu", "gpu", "tpu-v4", "tpu-v5e"],
)
def test_on_simulated_colab_with_an_old_jax_the_cell_says_how_to_upgrade_it(
    colab_like, tmp_path, version, device_files, command
):
    # A reader's runtime with jax 0.8.0 and the wheel uploaded: before, pip failed with
    # ResolutionImpossible (the cell held jax at 0.8.0; the package needs jax>=0.10).
    _, content = colab_like
    assert fnmatch.filter(os.listdir(content), "jaxdist_lessons-*.whl")
    # Another test installs the wheel in colab_like's venv; here pip never runs.
    python = runtime_venv(tmp_path / "venv")
    proc = run_cell(
        str(python),
        content,
        prelude=with_device_files(*device_files),
        COLAB_RELEASE_TAG="simulated",
        PYTHONPATH=str(old_jax(tmp_path, version)),
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.endswith(
        f"RuntimeError: This book needs jax 0.10.2; this runtime has jax {version}. Upgrade "
        f"it with\n    !{command}\nthen restart the session (Colab: Runtime > Restart "
        "session) and run this cell again.\n"
    )
    assert "pip" not in proc.stderr.replace(f"!{command}", "")  # pip never ran
