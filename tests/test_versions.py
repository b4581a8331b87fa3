"""The tested versions: kept equal to requirements.txt, and a warning that names what differs."""

import pathlib
import re

from jaxdist_lessons import versions

ROOT = pathlib.Path(__file__).resolve().parents[1]


def pins() -> dict[str, str]:
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return dict(
        m.groups() for line in lines if (m := re.match(r"^([\w.-]+)==([\w.]+)", line))
    )


def test_tested_versions_are_the_ones_requirements_pins():
    pinned = pins()
    assert {name: pinned[name] for name in versions.TESTED} == versions.TESTED


def test_this_environment_has_the_tested_versions():
    assert versions.untested() == {}
    assert versions.version_warning() is None


def test_warning_names_what_differs():
    found = {**versions.TESTED, "jax": "0.9.0", "flax": None}
    assert versions.untested(found) == {"jax": "0.9.0", "flax": None}
    assert versions.version_warning(found) == (
        "jaxdist: warning: this book is tested with jax 0.10.2, flax 0.12.8; found jax 0.9.0, "
        "flax missing. Most chapters still run, but printed numbers and error messages may differ."
    )
