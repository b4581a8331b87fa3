"""Regenerate the Chinese edition's gettext catalogs from the English chapters.

    python .ci/zh_catalogs.py              # templates into _build/gettext, then the catalogs
    python .ci/zh_catalogs.py --pot-only   # only the templates (what tests/test_zh.py does)

Step 1 builds the message templates, one ``.pot`` per page (``_build/gettext/book/03_sharding.pot``),
with Sphinx's gettext builder and a config derived from ``_config.yml``: nothing is executed
(the templates hold the prose, not the outputs) and ``gettext_compact`` is off. Step 2 runs
``sphinx-intl update``, which adds new messages to ``locale/zh_CN/LC_MESSAGES/book/*.po``, marks
the ones whose English changed as fuzzy (they fall back to English until a translator checks
them) and keeps every existing translation. Step 3 carries translations across pages: a message
left empty or fuzzy whose exact English is translated elsewhere (another page, or an entry made
obsolete when a passage moved to another page) takes that translation. Run it from anywhere; it
works in the repository root.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
LANGUAGE = "zh_CN"
# The jupyter-book of this Python's environment, even when that environment is not activated.
_BESIDE = pathlib.Path(sys.executable).parent / "jupyter-book"
JUPYTER_BOOK = str(_BESIDE) if _BESIDE.exists() else "jupyter-book"


def gettext_config(root: pathlib.Path = ROOT) -> dict:
    """``_config.yml`` with execution off and one message template per page."""
    config = yaml.safe_load((root / "_config.yml").read_text())
    config["execute"]["execute_notebooks"] = "off"
    sphinx = config.setdefault("sphinx", {}).setdefault("config", {})
    sphinx["gettext_compact"] = False
    # No source locations in the catalogs: they would change with every line added above a
    # message, and they are relative to the build folder.
    sphinx["gettext_location"] = False
    extensions = config["sphinx"].get("local_extensions") or {}
    # the config is written elsewhere: absolute paths
    for name, path in extensions.items():
        extensions[name] = str((root / path).resolve())
    return config


def build_templates(pot_dir: pathlib.Path, root: pathlib.Path = ROOT) -> pathlib.Path:
    """Write the ``.pot`` templates of every page under ``pot_dir``; returns ``pot_dir``."""
    pot_dir = pathlib.Path(pot_dir).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        config = pathlib.Path(tmp) / "gettext_config.yml"
        config.write_text(yaml.safe_dump(gettext_config(root), sort_keys=False))
        out = pathlib.Path(tmp) / "out"
        subprocess.run(
            [JUPYTER_BOOK, "build", str(root), "--builder", "custom"]
            + ["--custom-builder", "gettext", "--config", str(config)]
            + ["--path-output", str(out), "--quiet"],
            cwd=root,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        built = out / "_build" / "gettext"
        pot_dir.mkdir(parents=True, exist_ok=True)
        for pot in built.rglob("*.pot"):
            target = pot_dir / pot.relative_to(built)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(pot.read_bytes())
    return pot_dir


def update_catalogs(pot_dir: pathlib.Path, root: pathlib.Path = ROOT) -> None:
    """``sphinx-intl update``: the ``.po`` files under ``locale/`` follow the templates."""
    subprocess.run(
        [sys.executable, "-m", "sphinx_intl", "update", "-p", str(pot_dir)]
        + ["-l", LANGUAGE, "-d", str(root / "locale"), "--line-width", "-1"],
        cwd=root,
        check=True,
    )


def carry_translations(root: pathlib.Path = ROOT) -> int:
    """Fill each empty or fuzzy message whose exact English is translated in any catalog (obsolete
    entries included, so a passage moved to another page keeps its translation); how many."""
    from babel.messages.pofile import read_po, write_po

    paths = sorted((root / "locale" / LANGUAGE / "LC_MESSAGES").rglob("*.po"))
    catalogs = {}
    for path in paths:
        with path.open("rb") as f:
            catalogs[path] = read_po(f)
    memory = {}
    for catalog in catalogs.values():
        for message in [*catalog, *catalog.obsolete.values()]:
            if message.id and message.string and not message.fuzzy:
                memory.setdefault(message.id, message.string)
    filled = 0
    for path, catalog in catalogs.items():
        changed = 0
        for message in catalog:
            if (
                message.id
                and message.id in memory
                and (message.fuzzy or not message.string)
            ):
                message.string = memory[message.id]
                message.flags.discard("fuzzy")
                changed += 1
        if changed:
            with path.open("wb") as f:
                write_po(f, catalog, width=-1)
            filled += changed
    return filled


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pot-dir", default=str(ROOT / "_build" / "gettext"))
    parser.add_argument(
        "--pot-only", action="store_true", help="write only the templates"
    )
    args = parser.parse_args()
    pot_dir = build_templates(pathlib.Path(args.pot_dir))
    if not args.pot_only:
        update_catalogs(pot_dir)
        print(f"{carry_translations()} messages took a translation from another page")
