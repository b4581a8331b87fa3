"""Print a Jupyter Book config that builds the book from notebooks already executed.

CI runs every chapter once, under pytest (nbmake ``--overwrite`` writes each notebook's outputs
into its ``.ipynb``), and then builds the pages from those outputs instead of executing the
chapters a second time, for both editions. The config is ``_config.yml`` (or the one given with
``--config``, e.g. the Chinese edition's ``_config.zh.yml``) with three changes: each paired
chapter is read from its ``.ipynb`` rather than its MyST text, nothing is executed, and the
local extensions' folders are absolute (Jupyter Book resolves them against the config's folder).

    python .ci/executed_config.py > _build/executed_config.yml
    jupyter-book build . --config _build/executed_config.yml
    python .ci/executed_config.py --config _config.zh.yml > _build/zh_executed.yml
    jupyter-book build . --config _build/zh_executed.yml --path-output _build/zh
"""

import argparse
import pathlib
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]


def executed_config(
    root: pathlib.Path = ROOT, config_file: str = "_config.yml"
) -> dict:
    config = yaml.safe_load((root / config_file).read_text())
    paired = sorted(
        f"book/{md.name}"
        for md in (root / "book").glob("*.md")
        if md.with_suffix(".ipynb").exists()
    )
    excluded = [p for p in config["exclude_patterns"] if p != "book/*.ipynb"]
    config["exclude_patterns"] = excluded + paired
    config["execute"]["execute_notebooks"] = "off"
    extensions = config.get("sphinx", {}).get("local_extensions") or {}
    for name, path in extensions.items():
        extensions[name] = str((root / config_file).parent.joinpath(path).resolve())
    return config


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", default="_config.yml", help="relative to the repository"
    )
    args = parser.parse_args()
    config = executed_config(ROOT, args.config)
    yaml.safe_dump(config, sys.stdout, sort_keys=False, allow_unicode=True)
