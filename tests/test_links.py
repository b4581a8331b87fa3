"""No link to a documentation page known to be gone, nor into an old versioned copy of Flax's docs.

Dead: JAX's ``notebooks/explicit-sharding.html`` (deleted; the explicit-sharding material is in
``201/sharding.html``), and Linen's reference under ``flax.readthedocs.io`` (it moved to
``flax-linen.readthedocs.io``). Flax links must point at ``latest`` or ``stable``, not at a release
such as ``/en/v0.6.10/``. Checked per page: every chapter, the link map of ``.ci/link_first_uses.py``
and every Chinese catalog.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

DEAD = [
    re.compile(r"docs\.jax\.dev/en/[^/\s]+/notebooks/explicit-sharding\.html"),
    re.compile(r"flax\.readthedocs\.io/en/[^/\s]+/api_reference/flax\.linen"),
    re.compile(r"flax(?:-linen)?\.readthedocs\.io/en/(?!latest/|stable/)[^/\s)]+/"),
]
URL = re.compile(r"https?://[^\s)\]>\"'`]+")

_LINEN = "https://flax.readthedocs.io/en/latest/api_reference/flax.linen/spmd.html"
_EXPLICIT = "https://docs.jax.dev/en/latest/notebooks/explicit-sharding.html"
PAGES = sorted(
    [
        *(p.relative_to(ROOT).as_posix() for p in (ROOT / "book").glob("*.md")),
        ".ci/link_first_uses.py",
        *(
            p.relative_to(ROOT).as_posix()
            for p in (ROOT / "locale" / "zh_CN" / "LC_MESSAGES" / "book").glob("*.po")
        ),
    ]
)


def dead_links(text: str) -> set[str]:
    """The links in ``text`` that match a dead pattern."""
    urls = (url.rstrip(".,;:") for url in URL.findall(text))
    return {url for url in urls if any(d.search(url) for d in DEAD)}


def test_the_patterns_catch_what_they_should():
    assert dead_links(f"[a]({_EXPLICIT}) [b]({_LINEN})") == {_EXPLICIT, _LINEN}
    old = "https://flax.readthedocs.io/en/v0.6.10/api_reference/_autosummary/flax.linen.Dense.html"
    assert dead_links(f"see {old}.") == {old}
    live = [
        "https://flax-linen.readthedocs.io/en/latest/api_reference/flax.linen/spmd.html",
        "https://flax.readthedocs.io/en/latest/api_reference/flax.nnx/spmd.html",
        "https://flax.readthedocs.io/en/stable/guides/flax_gspmd.html",
        "https://docs.jax.dev/en/latest/201/sharding.html",
    ]
    assert dead_links(" ".join(live)) == set()


@pytest.mark.parametrize("page", PAGES)
def test_no_dead_link(page):
    found = dead_links((ROOT / page).read_text(encoding="utf-8"))
    assert not found, f"{page}: dead links {sorted(found)}"
