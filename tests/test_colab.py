"""The first cell of every chapter installs the package on Colab or Kaggle, and only there."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from jaxdist_lessons import colab

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAPTERS = [  # the notebooks' text sources (a plain page, the glossary, has no .ipynb)
    md for md in sorted((ROOT / "book").glob("*.md")) if md.with_suffix(".ipynb").exists()
]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_every_chapter_starts_with_the_install_cell(path):
    assert colab.first_code_cell(path.read_text()) == colab.INSTALL_CELL, (
        f"{path.name}: its first cell differs from jaxdist_lessons.colab.INSTALL_CELL; run "
        "`python -m jaxdist_lessons.colab` and `jupytext --sync book/*.md`"
    )
    [first] = [c for c in json.loads(path.with_suffix(".ipynb").read_text())["cells"]][
        :1
    ] or [None]
    notebook_cells = json.loads(path.with_suffix(".ipynb").read_text())["cells"]
    first = next(c for c in notebook_cells if c["cell_type"] == "code")
    assert first["metadata"]["tags"] == list(colab.TAGS)


def test_with_install_cell_inserts_once_and_replaces_after():
    chapter = "# Title\n\n```{code-cell}\nfrom jaxdist_lessons import devices\n```\n"
    once = colab.with_install_cell(chapter)
    assert colab.first_code_cell(once) == colab.INSTALL_CELL
    assert colab.with_install_cell(once) == once
    assert once.count("{code-cell}") == 2
    with pytest.raises(ValueError, match="no code cell found"):
        colab.with_install_cell("# no code here\n")


# A fresh runtime: no PYTHONPATH pointing at a checkout of the package.
FRESH = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def run_cell(python: str, cwd: pathlib.Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in FRESH.items() if not k.startswith(("COLAB", "KAGGLE"))}
    return subprocess.run(
        [python, "-c", colab.INSTALL_CELL],
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
            str(source),
            "-w",
            str(wheel_dir),
        ],
        check=True,
        timeout=600,
    )
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # A path line in a .pth file adds this environment's site-packages but does not run the
    # .pth files inside it, so the editable install of jaxdist_lessons stays invisible.
    pathlib.Path(site, "runtime.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, wheel_dir


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


def test_on_simulated_colab_the_cell_installs_the_uploaded_wheel_and_keeps_jax(colab_like):
    python, content = colab_like
    assert python_in(python, "import jaxdist_lessons", content).returncode == 1
    show_jax = "import jax; print(jax.__file__, jax.__version__)"
    jax_before = python_in(python, show_jax, content).stdout
    proc = run_cell(str(python), content, COLAB_RELEASE_TAG="simulated")
    assert proc.returncode == 0, proc.stderr
    installed = python_in(
        python, "import jaxdist_lessons; print(jaxdist_lessons.__file__)", content
    )
    assert installed.returncode == 0, installed.stderr
    assert str(python.parent.parent) in installed.stdout  # the wheel, not the editable copy
    assert python_in(python, show_jax, content).stdout == jax_before


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
