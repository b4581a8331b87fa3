"""Each chapter that passes under ``pytest`` leaves its outputs where the build looks.

``pytest`` executes every chapter (nbmake), and ``jupyter-book build .`` would execute
each one again to fill its pages. Instead, a chapter that passes at the book's device
count (no ``JAXDIST_NUM_DEVICES`` set) is filed in the build's own execution cache,
Jupyter Book's jupyter-cache (``execute.cache`` in ``_config.yml``), under the key the
build computes for it: the build reads the chapter's MyST text as myst-nb does, hashes
its code cells, finds the outputs and executes nothing. A chapter whose code changed
since, or that failed, is not found there, and the build executes it as usual. The
Chinese edition shares the same cache.
"""

import os
import pathlib

import filelock
import nbformat
import pytest
import yaml
from jupyter_cache import get_cache
from jupyter_cache.base import CacheBundleIn
from myst_nb.core.read import read_myst_markdown_notebook
from myst_parser.config.main import MdParserConfig
from nbmake.nb_run import NotebookRun

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())
CACHE = ROOT / CONFIG["execute"]["cache"]


def as_the_book_reads_it(md: pathlib.Path) -> nbformat.NotebookNode:
    """The chapter's notebook as the build reads its MyST text (myst-nb's reader)."""
    extensions = set(CONFIG["parse"]["myst_enable_extensions"])
    config = MdParserConfig(enable_extensions=extensions)
    return read_myst_markdown_notebook(
        md.read_text(), config=config, add_source_map=True, path=str(md)
    )


def file_for_the_build(
    executed: nbformat.NotebookNode, ipynb: pathlib.Path, cache: pathlib.Path = CACHE
) -> bool:
    """File ``executed`` (the outputs of ``ipynb``'s cells) in the build's ``cache``.

    Returns whether it was filed: not when the chapter has no MyST text, or when its
    code cells differ from the text's (a pair out of sync: the build executes the text).
    """
    md = ipynb.with_suffix(".md")
    if not md.exists():
        return False
    nb = as_the_book_reads_it(md)
    cells = [c for c in nb.cells if c.cell_type == "code"]
    ran = [c for c in executed.cells if c.cell_type == "code"]
    if [c.source for c in cells] != [c.source for c in ran]:
        return False
    for cell, run in zip(cells, ran, strict=True):
        cell.outputs = run.outputs
        cell.execution_count = run.execution_count
    if "language_info" in executed.metadata:
        nb.metadata["language_info"] = executed.metadata["language_info"]
    cache.parent.mkdir(parents=True, exist_ok=True)
    # pytest-xdist's workers may finish chapters at once; the cache is one SQLite file.
    with filelock.FileLock(f"{cache}.lock"):
        get_cache(str(cache)).cache_notebook_bundle(
            CacheBundleIn(nb, str(md)), check_validity=False, overwrite=True
        )
    return True


# nbmake executes each chapter through NotebookRun.execute and keeps only pass or fail.
# tests/test_book_cache.py imports this file again: wrap nbmake's own method once.
_execute = getattr(NotebookRun.execute, "__wrapped__", NotebookRun.execute)


def _execute_and_file(run: NotebookRun):
    """Execute a chapter as nbmake does, and file it for the build if it passed. The
    chapters compile as the package tests do (../conftest.py's XLA_FLAGS): the same
    HLO programs, so the same shardings, collectives, bytes and, to float32 rounding,
    losses, compiled in about a third of the time into less optimised code. What that
    changes on a page, each page says: step times and tokens per second (every job names
    its XLA_FLAGS under its output) and chapter 5's accuracies."""
    result = _execute(run)
    if result.error is None and not os.environ.get("JAXDIST_NUM_DEVICES"):
        file_for_the_build(result.nb, pathlib.Path(run.filename))
    return result


_execute_and_file.__wrapped__ = _execute
NotebookRun.execute = _execute_and_file


# Chapters that submit jobs to the one-node SLURM cluster of .ci/slurm-up.
SLURM_CHAPTERS = {"07_troubleshooting.ipynb", "08_multi_host.ipynb"}


def pytest_itemcollected(item):
    """Under pytest-xdist, these run on the worker of the tests that use the cluster
    (``xdist_group("slurm")``, as tests/conftest.py marks them), one job at a time."""
    if item.path.name in SLURM_CHAPTERS:
        item.add_marker(pytest.mark.xdist_group("slurm"))
