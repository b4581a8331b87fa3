"""The first cell of every chapter: on Colab or Kaggle, install this package if it is missing.

The cell is kept here, once, with the install source. ``python -m jaxdist_lessons.colab``
writes it as the first code cell of every chapter's text source (``book/*.md``; then
``jupytext --sync``), and ``tests/test_colab.py`` fails when a chapter's cell differs from it.

What the cell does, only on a hosted runtime (Colab sets ``COLAB_RELEASE_TAG``, Kaggle
``KAGGLE_KERNEL_RUN_TYPE``) where ``jaxdist_lessons`` cannot be imported:

- it finds the install source: ``$JAXDIST_SOURCE`` if set, else the newest
  ``jaxdist_lessons-*.whl`` uploaded to the working directory, ``/content`` or a Kaggle input;
- if the runtime's JAX is older than 0.10 (the package needs ``jax>=0.10``), it stops at once
  with the JAX the book needs, the one the runtime has, and the ``pip install -U`` command for
  the runtime's accelerator, told apart as JAX itself does without starting it (JAX's
  ``hardware_utils``: ``/dev/nvidiactl`` for an NVIDIA GPU; a TPU VM's chips appear as
  ``/dev/accel*``, or under ``/dev/vfio`` from v5e on); then the reader restarts the runtime;
- it installs it with pip, holding ``jax`` and ``jaxlib`` at the runtime's versions, so the
  runtime's accelerator build of JAX is never replaced (``devices.setup()`` then warns if that
  version differs from the tested one);
- with no source found, it stops with a message that says what to upload.

Anywhere else (a laptop, CI) it does nothing.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
from collections.abc import Sequence

# The install source is configured here, once: $JAXDIST_SOURCE if set, else the newest wheel
# (built with `pip wheel --no-deps . -w dist`) uploaded to the notebook's files (Colab) or added
# as a dataset (Kaggle). Change these lines when the package gets a public home.
INSTALL_CELL = """\
# On Colab or Kaggle, install the book's companion package; elsewhere, do nothing.
import glob
import importlib.metadata
import importlib.util
import os
import subprocess
import sys

JAX = "0.10.2"  # the JAX this book is tested with; its package needs jax 0.10 or later
WHEELS = ["*.whl", "/content/*.whl", "/kaggle/input/*/*.whl"]
hosted = "COLAB_RELEASE_TAG" in os.environ or "KAGGLE_KERNEL_RUN_TYPE" in os.environ
if hosted and importlib.util.find_spec("jaxdist_lessons") is None:
    have = importlib.metadata.version("jax")
    if tuple(int(n) for n in have.split(".")[:2]) < (0, 10):
        tpu = glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
        extra = (
            "[cuda12]" if os.path.exists("/dev/nvidiactl") else "[tpu]" if tpu else ""
        )
        raise RuntimeError(
            f"This book needs jax {JAX}; this runtime has jax {have}. Upgrade it with\\n"
            f'    !pip install -U "jax{extra}=={JAX}"\\n'
            "then restart the session (Colab: Runtime > Restart session) and run this "
            "cell again."
        )
    found = sorted(w for p in WHEELS for w in glob.glob(p) if "jaxdist_lessons-" in w)
    source = os.environ.get("JAXDIST_SOURCE") or (found[-1] if found else None)
    if source is None:
        raise RuntimeError(
            "Upload jaxdist_lessons-*.whl (made by `pip wheel --no-deps . -w dist` in "
            "the book's repository) to this notebook's files, or set JAXDIST_SOURCE."
        )
    # Hold jax and jaxlib at the runtime's versions: its accelerator build stays.
    keep = [f"{n}=={importlib.metadata.version(n)}" for n in ("jax", "jaxlib")]
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, source, *keep], check=True)
"""

# in the HTML book the cell is folded away; on Colab it runs like any other
TAGS = ("hide-cell",)

_FIRST_CELL = re.compile(
    r"```\{code-cell\}\n(?::tags: \[[^\]]*\]\n\n)?(?P<code>.*?)```\n", re.S
)


def cell_markdown() -> str:
    """The cell as it stands in a MyST Markdown notebook."""
    return f"```{{code-cell}}\n:tags: [{', '.join(TAGS)}]\n\n{INSTALL_CELL}```\n"


def with_install_cell(text: str) -> str:
    """``text`` (a MyST Markdown chapter) with the install cell first: replaced, or inserted."""
    match = _FIRST_CELL.search(text)
    if match is None:
        raise ValueError("no code cell found: every chapter starts with its setup cell")
    # An install cell, this one or an older wording: it tests for a hosted runtime.
    if "KAGGLE_KERNEL_RUN_TYPE" in match.group("code"):
        return text[: match.start()] + cell_markdown() + text[match.end() :]
    return text[: match.start()] + cell_markdown() + "\n" + text[match.start() :]


def main(argv: Sequence[str] | None = None) -> int:
    """Write the install cell into each chapter given (default: ``book/*.md``)."""
    parser = argparse.ArgumentParser(
        prog="python -m jaxdist_lessons.colab", description=__doc__
    )
    parser.add_argument("chapters", nargs="*", type=pathlib.Path)
    args = parser.parse_args(argv)
    chapters = (
        args.chapters
        or [  # the notebooks' text sources; a plain page has no .ipynb
            md
            for md in sorted(pathlib.Path("book").glob("*.md"))
            if md.with_suffix(".ipynb").exists()
        ]
    )
    for path in chapters:
        text = path.read_text()
        updated = with_install_cell(text)
        if updated != text:
            path.write_text(updated)
            print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
