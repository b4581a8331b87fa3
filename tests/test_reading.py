"""reading: words and visible code cells of a page, the estimate, and the table of contents' order."""

import pathlib

from jaxdist_lessons import reading

ROOT = pathlib.Path(__file__).resolve().parents[1]

PAGE = """---
jupytext:
  formats: ipynb,md:myst
---

# A page title

Four words of prose.

```{code-cell}
x = 1
```

```{code-cell}
:tags: [remove-cell]

assert x == 1
```

```python
shown = "a fence, counted as prose"
```
"""


def test_a_page_counts_prose_words_and_visible_cells(tmp_path):
    path = tmp_path / "page.md"
    path.write_text(PAGE)
    size = reading.page_size(path)
    assert size.title == "A page title"
    assert size.code_cells == 1  # the remove-cell is hidden in the book
    # "# A page title" (4 tokens), the sentence (4), the fence's two lines of backticks (2) and its code (7)
    assert size.words == 4 + 4 + 2 + 7


def test_the_estimate_is_words_and_cells_rounded_up_to_five_minutes():
    assert reading.estimate_minutes(0, 0) == 5
    assert reading.estimate_minutes(2000, 0) == 10  # 200 words a minute
    assert reading.estimate_minutes(2000, 1) == 15  # one more minute rounds up to 15
    assert reading.estimate_minutes(1000, 20) == 25


def test_the_book_is_read_in_the_order_of_its_table_of_contents():
    pages = reading.toc_pages(ROOT)
    assert pages[0] == "book/00_preface" and "book/01_why_distribute" in pages
    sizes = reading.book_sizes(ROOT)
    assert [s.name for s in sizes] == [p.split("/")[-1] for p in pages]
    assert all(s.words > 0 for s in sizes)
