"""The "Plan your run" page in a real browser: the planner in Pyodide against the planner here.

Serves on localhost the files the book ships for the page (``_ext/planner.py``'s ``ship``: the
page's form and script, Pyodide from ``node_modules``, the planner's modules), opens them in
headless Chromium (Debian's ``chromium``, driven by Playwright from PyPI), fills the form for
100 random valid requests (seeded) and a few invalid ones, and compares every table cell, the
figure's bars and every error message with ``jaxdist_lessons.planning`` run in this process.
Pyodide loads once for the whole test. Skipped when Chromium, Playwright or ``npm ci``'s
Pyodide is missing, unless ``JAXDIST_REQUIRE_BROWSER=1`` (CI sets it).
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import io
import os
import pathlib
import random
import shutil
import sys
import threading
import time

import pytest

from jaxdist_lessons.planning import cli, ranking
from jaxdist_lm import model_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "_ext"))
import planner  # noqa: E402  (_ext/planner.py, the Sphinx extension)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VALID, SEED = 100, 27


def _missing() -> str | None:
    if CHROMIUM is None:
        return "no chromium on PATH (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "no playwright (pip install -r requirements.txt)"
    if not (planner.PYODIDE / "pyodide.asm.wasm").exists():
        return "no node_modules/pyodide (npm ci)"
    return None


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The page's files as the book ships them, behind a page that holds the form."""
    reason = _missing()
    if reason:
        if os.environ.get("JAXDIST_REQUIRE_BROWSER") == "1":
            pytest.fail(f"JAXDIST_REQUIRE_BROWSER=1 but {reason}")
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("site")
    planner.ship(root / "_static" / "planner")
    form = (planner.PAGE_FILES / "form.html").read_text()
    (root / "index.html").write_text(
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<link rel="stylesheet" href="_static/planner/planner.css">'
        '<script defer src="_static/planner/planner.js"></script></head>'
        f"<body>{form}</body></html>"
    )
    handler = functools.partial(_Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/index.html"
    server.shutdown()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


# The form's select boxes: each of their options comes up among the 100 requests.
CHOICES = {
    "model": [*model_config.PRESETS, ""],
    "chip": list(cli.CHIP_NAMES),
    "dtype": ["bfloat16", "float32"],
    "remat": ["full", "dots", "none"],
}


def random_request(rng: random.Random) -> dict[str, str]:
    """Form values: a preset or a shape, experts or not, devices, nodes, chip, tokens."""
    devices = rng.choice([1, 2, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256])
    choose = lambda field: rng.choice(CHOICES[field])
    values = {
        "model": choose("model"),
        "devices": devices,
        "nodes": rng.choice([n for n in (1, 2, 3, 4, 8, 16) if devices % n == 0]),
        "chip": choose("chip"),
        "seq-len": rng.choice([256, 512, 1024, 2048, 4096, 8192]),
        "global-batch": rng.choice([8, 16, 32, 64, 128, 256, 512]),
        "dtype": choose("dtype"),
        "remat": choose("remat"),
        "grad-accum": rng.choice(["auto", "auto", "1", "2"]),
        "experts": 0,
        "top-k": 1,
    }
    if rng.random() < 0.25:
        values["experts"] = rng.choice([4, 8])
        values["top-k"] = rng.choice([1, 2])
    if values["model"] == "":
        heads = rng.choice([4, 8, 16])
        values.update(
            {
                "layers": rng.choice([2, 8, 24]),
                "width": heads * rng.choice([64, 128]),
                "heads": heads,
                "kv-heads": rng.choice([1, 2, 4]),
                "mlp-width": rng.choice([512, 1024, 4096]),
                "vocab": rng.choice([1000, 32_000, 50_304]),
                "head-dim": rng.choice(["", "", "96", "256"]),  # heads of their own
                "tie-embeddings": rng.choice(["", "yes"]),
            }
        )
    return {k: str(v) for k, v in values.items()}


# Bad input the form lets a reader type: each gets the planner's one-line message.
INVALID = [
    {"devices": "0"},
    {"devices": "eight"},
    {"devices": "6", "nodes": "4"},
    {"model": "", "layers": "4"},
    {
        "model": "",
        "layers": "2",
        "width": "100",
        "heads": "3",
        "kv-heads": "1",
        "mlp-width": "256",
        "vocab": "1000",
    },
    {"model": "70b", "devices": "2", "global-batch": "64"},
    {"global-batch": "-8"},
    {"experts": "4", "top-k": "5"},
    {"devices": "1000000"},
    {"chip": "v5p", "dtype": "float32"},
    {"grad-accum": "0"},
]


SHAPE = ["layers", "width", "heads", "kv-heads", "mlp-width", "vocab"]
OPTIONAL = ["head-dim", "tie-embeddings"]  # a custom shape's, left empty by default
# The form's values when the page opens (form.html).
DEFAULTS = {
    "model": "8b",
    "experts": "0",
    "top-k": "1",
    "devices": "16",
    "nodes": "2",
    "chip": "h100",
    "seq-len": "8192",
    "global-batch": "256",
    "dtype": "bfloat16",
    "remat": "full",
    "grad-accum": "auto",
}


def flags(values: dict[str, str]) -> list[str]:
    """The command line the page builds from the form (planner.js's ``argv``)."""
    form = {**DEFAULTS, **values}
    out = ["--model", form["model"]] if form["model"] else []
    if not form["model"]:
        out += [x for k in SHAPE if form.get(k) for x in (f"--{k}", form[k])]
        out += ["--head-dim", form["head-dim"]] if form.get("head-dim") else []
        out += ["--tie-embeddings"] if form.get("tie-embeddings") == "yes" else []
    return out + [x for k in list(DEFAULTS)[1:] for x in (f"--{k}", form[k])]


def expected(argv: list[str]) -> dict:
    """What the planner here says: the table's cells, or ``main``'s line on stderr."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        status = cli.main(argv)
    if status:
        return {"error": stderr.getvalue().strip()}
    run = cli.make_run(cli.parse_args(argv))
    rows = cli.fitting_plan(run)
    shown = ranking.table(run, rows)
    return {
        "title": shown.title,
        "headers": shown.headers,
        "cells": shown.rows,
        "totals": [r["memory_bytes"]["total"] for r in rows],
    }


READ = """() => {
  const error = document.getElementById("planner-error");
  if (!error.hidden) return {error: error.textContent};
  const table = document.getElementById("planner-table");
  return {title: table.caption.textContent,
          headers: [...table.tHead.rows[0].cells].map((c) => c.textContent),
          cells: [...table.tBodies[0].rows].map((r) => [...r.cells].map((c) => c.textContent)),
          totals: [...document.querySelectorAll("#planner-figure .planner-bar")]
                    .map((g) => Number(g.dataset.totalBytes))};
}"""


# Types each value into its field (as typing would, with input and change events) in one
# round trip to the browser: Playwright's page.fill per field costs 10 round trips a request.
TYPE = """(values) => {
  const form = document.getElementById("planner-form");
  for (const [name, value] of Object.entries(values)) {
    const field = form.elements[name];
    if (field.type === "checkbox") field.checked = value === "yes";
    else field.value = value;
    field.dispatchEvent(new Event("input", {bubbles: true}));
    field.dispatchEvent(new Event("change", {bubbles: true}));
  }
}"""


def fill(page, values: dict[str, str]) -> None:
    """Enter the request into the form, as a reader would, and press Plan."""
    form = {**DEFAULTS, **values}
    if not form["model"]:  # the shape's fields count for a custom shape only
        form.update({name: form.get(name, "") for name in [*SHAPE, *OPTIONAL]})
    page.evaluate(TYPE, form)
    page.click("#planner-submit")


def test_the_page_gives_the_planners_tables_and_errors(site):
    from playwright.sync_api import sync_playwright

    rng = random.Random(SEED)
    requests, valid = [], 0
    while valid < VALID:
        values = random_request(rng)
        if "error" not in expected(flags(values)):
            valid += 1
            requests.append(values)
    # every preset and a custom shape, every chip, both dtypes, experts, several nodes
    for field in ("model", "chip", "dtype", "remat"):
        assert len({v[field] for v in requests}) == len(CHOICES[field])
    assert {v["experts"] for v in requests} > {"0"} and {
        v["nodes"] for v in requests
    } > {"1"}
    assert any(v.get("head-dim") for v in requests)  # custom heads, and tied tables
    assert any(v.get("tie-embeddings") for v in requests)
    requests += INVALID
    start = time.perf_counter()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page()
        console = []
        page.on("pageerror", lambda error: console.append(str(error)))
        page.goto(site)
        page.wait_for_selector("#planner-form[data-ready='1']", timeout=60_000)
        loaded = time.perf_counter() - start
        errors = 0
        for values in requests:
            fill(page, values)
            got, want = page.evaluate(READ), expected(flags(values))
            if "error" in want:
                errors += 1
                assert got == {"error": want["error"]}, values
                assert "Traceback" not in got["error"]
            else:
                assert got == want, values
            assert page.text_content("#planner-command") == " ".join(
                ["python -m jaxdist_lessons.planning", *flags(values)]
            )
        browser.close()
    seconds = time.perf_counter() - start
    print(
        f"Pyodide loaded in {loaded:.1f} s; {len(requests)} requests in {seconds:.1f} s"
    )
    assert not console, console
    assert errors >= len(INVALID)
    assert seconds < 120
