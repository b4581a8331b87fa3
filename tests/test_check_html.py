"""The CI check of the built HTML book (.ci/check_html.py), on pages made up for the test."""

import pathlib

from by_path import load

check_html = load("check_html", ".ci/check_html.py")

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
    page = PAGE + f'<pre>File "{tmp_path}/jaxdist_lessons/hang_lab.py", line 1</pre>'
    assert check_html.problems(*book(tmp_path, CHAPTER, page)) == [
        f"01_chapter.html: the build machine's path {tmp_path}"
    ]


def code_block(code: str, kind: str = "ipython3") -> str:
    """A block of code as the book's HTML shows it (Pygments' spans left out)."""
    return (
        f'<div class="highlight-{kind} notranslate"><div class="highlight">'
        f"<pre><span></span>{code}</pre></div></div>"
    )


def cell(code: str, output: str = "") -> str:
    """A code cell: its input and, if any, its output, which may scroll."""
    shown = (
        '<div class="cell_output docutils container">'
        '<div class="output stream highlight-myst-ansi notranslate">'
        f'<div class="highlight"><pre><span></span>{output}</pre></div></div></div>'
    )
    return (
        '<div class="cell docutils container"><div class="cell_input docutils container">'
        + code_block(code)
        + "</div>"
        + (shown if output else "")
        + "</div>"
    )


FITS = "x = " + "1 + " * 20 + "1000"  # 88 columns
WIDE = f'print("{"a" * 82}")'  # 91 columns


def test_code_that_fits_passes_and_outputs_may_be_wider(tmp_path):
    assert len(FITS) == check_html.CODE_WIDTH
    chapter = CHAPTER + f"\n```{{code-cell}}\n{FITS}\n{WIDE}\n```\n"
    page = PAGE + cell(FITS, output="b" * 120) + cell("y = 1", output=WIDE)
    assert check_html.problems(*book(tmp_path, chapter, page)) == []


def test_a_wide_line_of_a_cell_is_reported_with_its_line_in_the_chapter(tmp_path):
    chapter = CHAPTER + f"\n```{{code-cell}}\ny = 2\n{WIDE}\n```\n"
    page = PAGE + cell("y = 2\n" + WIDE.replace('"', "&quot;"))
    assert check_html.problems(*book(tmp_path, chapter, page)) == [
        "01_chapter.html: code block 1, line 2: 91 columns (over 88), "
        f"from 01_chapter.md:10: {WIDE[:60]}"
    ]


def test_a_wide_line_that_a_page_includes_names_its_file_and_function(tmp_path):
    (tmp_path / "lessons.py").write_text(
        f'def short():\n    return 1\n\n\ndef helper():\n    """{"d" * 86}."""\n'
    )
    chapter = CHAPTER + "\n```{literalinclude} ../lessons.py\n:pyobject: helper\n```\n"
    docstring = f'    """{"d" * 86}."""'
    page = PAGE + code_block(f"def helper():\n{docstring}\n", kind="python")
    found = check_html.problems(*book(tmp_path, chapter, page))
    assert found == [
        "01_chapter.html: code block 1, line 2: 97 columns (over 88), "
        f"from lessons.py:6 (helper): {docstring.strip()[:60]}"
    ]
    assert check_html.included_summary(found + found) == ["lessons.py: helper line 6"]


def test_the_code_only_check_leaves_the_figures_out(tmp_path):
    chapter = CHAPTER + f"\n```{{code-cell}}\n{WIDE}\n```\n"
    html, chapters = book(tmp_path, chapter, cell(WIDE))
    assert check_html.problems(html, chapters, code_only=True) == [
        "01_chapter.html: code block 1, line 1: 91 columns (over 88), "
        f"from 01_chapter.md:9: {WIDE[:60]}"
    ]
