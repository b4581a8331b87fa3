"""book/conftest.py files each chapter that passes under pytest in the build's jupyter-cache."""

import os
import pathlib
import subprocess
import sys

import nbformat
import pytest
from by_path import load
from jupyter_cache import get_cache
from nbmake.nb_run import NotebookRun

book_conftest = load("book_conftest", "book/conftest.py")
ROOT = pathlib.Path(__file__).resolve().parents[1]

PAGE = """\
---
jupytext:
  text_representation:
    extension: .md
    format_name: myst
kernelspec:
  display_name: Python 3
  language: python
  name: python3
---

# A page

```{code-cell} ipython3
:tags: [hide-input]
x = 6 * 7
```

Some text.

```{code-cell} ipython3
print(x)
```
"""


def executed(sources: list[str], printed: str) -> nbformat.NotebookNode:
    """A notebook as nbmake returns it: the code cells, the last one with an output."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nb.cells[-1].outputs = [
        nbformat.v4.new_output("stream", name="stdout", text=printed)
    ]
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def test_the_build_finds_a_passed_chapter_and_its_outputs(tmp_path):
    md = tmp_path / "page.md"
    md.write_text(PAGE)
    cache = tmp_path / "cache"
    ran = executed(["x = 6 * 7", "print(x)"], "42\n")
    assert book_conftest.file_for_the_build(ran, md.with_suffix(".ipynb"), cache)
    # The build reads the page as myst-nb does and looks it up by its code cells.
    page = book_conftest.as_the_book_reads_it(md)
    _, merged = get_cache(str(cache)).merge_match_into_notebook(page)
    code = [c for c in merged.cells if c.cell_type == "code"]
    assert code[1].outputs[0]["text"] == "42\n"
    assert code[0].metadata["tags"] == ["hide-input"]  # the page's own cell options

    # A page whose code changed since is not found: the build executes it.
    md.write_text(PAGE.replace("6 * 7", "6 * 9"))
    changed = book_conftest.as_the_book_reads_it(md)
    try:
        get_cache(str(cache)).match_cache_notebook(changed)
        raise AssertionError("a changed page matched the old outputs")
    except KeyError:
        pass


def test_a_pair_out_of_sync_or_without_text_is_not_filed(tmp_path):
    md = tmp_path / "page.md"
    md.write_text(PAGE)
    cache = tmp_path / "cache"
    stale = executed(["x = 6 * 9", "print(x)"], "54\n")
    assert not book_conftest.file_for_the_build(stale, md.with_suffix(".ipynb"), cache)
    alone = tmp_path / "alone.ipynb"
    assert not book_conftest.file_for_the_build(stale, alone, cache)
    assert not cache.exists()


def printed_xla_flags(page: pathlib.Path) -> list[str]:
    """The XLA_FLAGS a notebook named ``page`` sees when pytest runs it."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import os; print(os.environ['XLA_FLAGS'])")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nbformat.write(nb, page)
    result = NotebookRun(page, 120).execute()
    assert result.error is None
    return result.nb.cells[0].outputs[0]["text"].split()


@pytest.mark.skipif(
    os.environ.get("JAXDIST_FAST_COMPILE") == "0", reason="JAXDIST_FAST_COMPILE=0"
)
def test_chapters_compile_as_the_tests_do(tmp_path):
    """conftest.py's flags reach every chapter's kernel, chapter 5's too."""
    flags = os.environ["XLA_FLAGS"].split()
    fast = ["--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"]
    assert set(fast) <= set(flags)
    for page in ("02_device_mesh.ipynb", "05_resnet50.ipynb"):
        assert printed_xla_flags(tmp_path / page) == flags


def test_pytest_book_alone_compiles_as_the_tests_do(tmp_path):
    """``pytest book/`` (CI's second run of the chapters, on 6 devices) reads the root
    conftest.py too, so its kernels get the same flags and cache: tests/conftest.py,
    where they once were, is read only when pytest collects tests/."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os\n"
        "def pytest_collection_finish(session):\n"
        "    print('FLAGS', os.environ.get('XLA_FLAGS', ''))\n"
        "    print('CACHE', os.environ.get('JAX_COMPILATION_CACHE_DIR', ''))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env["PYTHONPATH"] = str(tmp_path)
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-n", "0", "-p", "probe"]
        + ["-p", "no:cacheprovider", "book/setup.ipynb"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    printed = dict(
        line.split(" ", 1) for line in ran.stdout.splitlines() if " " in line
    )
    fast = ["--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"]
    assert printed["FLAGS"].split() == fast
    assert printed["CACHE"] == str(ROOT / "_build" / "jax_cache")
