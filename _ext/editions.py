"""Links between the English and the Chinese edition, on every page.

The published layout: the English edition at the site's root, the Chinese edition under ``zh/``
(``_build/html`` copied to the root, ``_build/zh/_build/html`` to ``zh/``). Each page gets an
announcement bar (sphinx-book-theme's ``announcement``) with a relative link to the same page in
the other edition, computed per page, so it is right at any depth and with no JavaScript.
Both editions build every page from the same sources, so the other page always exists.
"""

from __future__ import annotations

import html

ZH_DIR = "zh"  # where the Chinese edition is published, relative to the English one

# (the other edition's folder relative to this one, the bar's text, the link's text)
BARS = {
    "en": ("zh/", "本书也有中文版：", "阅读本页的中文版"),
    "zh": ("../", "This book is also in English: ", "read this page in English"),
}


def edition(language: str | None) -> str:
    return "zh" if (language or "").lower().startswith("zh") else "en"


def other_edition_uri(language: str | None, pagename: str) -> str:
    """The page ``pagename`` of the other edition, relative to the root of this edition."""
    prefix = BARS[edition(language)][0]
    return f"{prefix}{pagename}.html"


def announcement(app, pagename: str, templatename: str, context: dict, doctree) -> None:
    if "pathto" not in context:
        return
    prefix, text, link = BARS[edition(app.config.language)]
    # pathto(..., resource=1) makes the link relative to the current page, whatever its depth.
    href = context["pathto"](other_edition_uri(app.config.language, pagename), 1)
    lang = "en" if edition(app.config.language) == "zh" else "zh-CN"
    context["theme_announcement"] = (
        f'{html.escape(text)}<a class="jaxdist-edition" hreflang="{lang}" '
        f'href="{html.escape(href)}">{html.escape(link)}</a>'
    )


def setup(app):
    app.connect("html-page-context", announcement)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
