"""The CI check of the built HTML book (.ci/check_html.py), on pages made up for the test."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location(
    "check_html", ROOT / ".ci" / "check_html.py"
)
check_html = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_html)

CHAPTER = "# 1. A chapter\n\n```{code-cell}\nfig = plots.f()\nplots.show(fig)\n```\n"
PAGE = (
    '<div class="cell_output"><img alt="_images/a.png" src="../_images/a.png" /></div>'
)


def book(
    tmp_path: pathlib.Path, chapter: str, page: str | None
) -> tuple[pathlib.Path, pathlib.Path]:
    (tmp_path / "book").mkdir()
    (tmp_path / "book" / "01_chapter.md").write_text(chapter)
    html = tmp_path / "html"
    (html / "book").mkdir(parents=True)
    if page is not None:
        (html / "book" / "01_chapter.html").write_text(page)
    return html, tmp_path / "book"


def test_a_page_with_its_figure_and_no_noise_passes(tmp_path):
    assert check_html.problems(*book(tmp_path, CHAPTER, PAGE)) == []


def test_a_missing_figure_is_reported(tmp_path):
    assert check_html.problems(*book(tmp_path, CHAPTER, "<p>no image</p>")) == [
        "01_chapter.html: 0 images for 1 figures the chapter makes"
    ]


def test_a_numbered_chapter_without_figures_is_reported(tmp_path):
    html, chapters = book(
        tmp_path, "# 1. A chapter\n\n```{code-cell}\nx = 1\n```\n", ""
    )
    assert check_html.problems(html, chapters) == [
        "01_chapter.md: a numbered chapter with no figure"
    ]


def test_noise_is_reported(tmp_path):
    noisy = (
        PAGE + '<div class="output stderr"><pre>\x1b[31mIProgress not found</pre></div>'
    )
    assert check_html.problems(*book(tmp_path, CHAPTER, noisy)) == [
        "01_chapter.html: a stderr output",
        "01_chapter.html: an ANSI escape code",
        "01_chapter.html: tqdm's IProgress warning",
    ]


def test_a_missing_page_is_reported(tmp_path):
    html, chapters = book(tmp_path, CHAPTER, None)
    assert check_html.problems(html, chapters) == [
        f"{html}/book/01_chapter.html: missing"
    ]


def test_the_build_machines_path_is_reported(tmp_path):
    page = PAGE + f'<pre>File "{tmp_path}/jaxdist_lessons/watchdog.py", line 1</pre>'
    assert check_html.problems(*book(tmp_path, CHAPTER, page)) == [
        f"01_chapter.html: the build machine's path {tmp_path}"
    ]
