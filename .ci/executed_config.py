"""Print a Jupyter Book config that builds the book from notebooks already executed.

CI runs every chapter once, under pytest (nbmake ``--overwrite`` writes each notebook's outputs
into its ``.ipynb``), and then builds the pages from those outputs instead of executing the
chapters a second time. The config is ``_config.yml`` with two changes: each paired chapter is
read from its ``.ipynb`` rather than its MyST text, and nothing is executed.

    python .ci/executed_config.py > _build/executed_config.yml
    jupyter-book build . --config _build/executed_config.yml
"""

import pathlib
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]


def executed_config(root: pathlib.Path = ROOT) -> dict:
    config = yaml.safe_load((root / "_config.yml").read_text())
    paired = sorted(
        f"book/{md.name}"
        for md in (root / "book").glob("*.md")
        if md.with_suffix(".ipynb").exists()
    )
    excluded = [p for p in config["exclude_patterns"] if p != "book/*.ipynb"]
    config["exclude_patterns"] = excluded + paired
    config["execute"]["execute_notebooks"] = "off"
    return config


if __name__ == "__main__":
    yaml.safe_dump(executed_config(), sys.stdout, sort_keys=False, allow_unicode=True)
