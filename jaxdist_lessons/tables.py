"""A small table that prints as text and renders as HTML in a notebook."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any


class Table:
    """Rows under headers. ``print(table)`` gives aligned text; notebooks show an HTML table."""

    def __init__(
        self, headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = ""
    ):
        self.headers = [str(h) for h in headers]
        self.values = [list(row) for row in rows]
        """The rows as given, before formatting: what a chapter's hidden checks read."""
        self.rows = [[_cell(v) for v in row] for row in rows]
        bad = [row for row in self.rows if len(row) != len(self.headers)]
        if bad:
            raise ValueError(
                f"every row needs {len(self.headers)} cells; got {bad[0]!r}"
            )
        self.title = title

    def __str__(self) -> str:
        widths = [max(len(c) for c in col) for col in zip(self.headers, *self.rows)]
        line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
        out = [self.title] if self.title else []
        out += [line(self.headers), "  ".join("-" * w for w in widths)]
        out += [line(row) for row in self.rows]
        return "\n".join(out)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        cell = 'style="padding: 2px 12px; text-align: right"'
        head = "".join(f"<th {cell}>{html.escape(h)}</th>" for h in self.headers)
        body = "".join(
            "<tr>" + "".join(f"<td {cell}>{html.escape(c)}</td>" for c in row) + "</tr>"
            for row in self.rows
        )
        caption = f"<caption>{html.escape(self.title)}</caption>" if self.title else ""
        return (
            f'<table style="border-collapse: collapse">{caption}<thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>"
        )


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def human_bytes(n: float, binary: bool = False) -> str:
    """``700 GB`` (powers of 1000) or, with ``binary=True``, ``651.9 GiB`` (powers of 1024)."""
    base, units = (
        (1024, ["B", "KiB", "MiB", "GiB", "TiB", "PiB"])
        if binary
        else (1000, ["B", "kB", "MB", "GB", "TB", "PB"])
    )
    value, unit = float(n), units[0]
    for unit in units:
        if abs(value) < base or unit == units[-1]:
            break
        value /= base
    return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
