"""One small table type that prints as fixed-width text in a terminal and as HTML in a notebook.

    >>> t = Table(["layer", "params"], align="lr")
    >>> t.add("embed", "38.60 M")
    >>> print(t)
    layer   params
    -----  -------
    embed  38.60 M
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field


@dataclass
class Table:
    """Rows of strings under a header. ``align`` has one letter per column: ``l`` left, ``r`` right."""

    header: list[str]
    align: str = ""
    rows: list[list[str]] = field(default_factory=list)
    title: str = ""
    footer: list[str] = field(default_factory=list)
    """Lines printed under the table (totals explained, notes)."""

    def add(self, *cells: object) -> None:
        self.rows.append([str(c) for c in cells])

    def rule(self) -> None:
        """A separator line before the next row (e.g. before a totals row)."""
        self.rows.append([])

    def _align(self, i: int) -> str:
        return self.align[i] if i < len(self.align) else "l"

    def __str__(self) -> str:
        widths = [len(h) for h in self.header]
        for row in self.rows:
            for i, cell in enumerate(row):
                widths[i] = max(widths[i], len(cell))

        def line(cells: list[str]) -> str:
            parts = [c.ljust(w) if self._align(i) == "l" else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
            return "  ".join(parts).rstrip()

        rule = "  ".join("-" * w for w in widths)
        out = [self.title] if self.title else []
        out += [line(self.header), rule]
        out += [line(row) if row else rule for row in self.rows]
        out += self.footer
        return "\n".join(out)

    def _repr_html_(self) -> str:
        def cell(tag: str, text: str, i: int) -> str:
            side = "left" if self._align(i) == "l" else "right"
            return f'<{tag} style="text-align:{side}">{html.escape(text)}</{tag}>'

        head = "".join(cell("th", h, i) for i, h in enumerate(self.header))
        body = "".join(
            "<tr>" + "".join(cell("td", c, i) for i, c in enumerate(row)) + "</tr>" for row in self.rows if row
        )
        caption = f"<caption>{html.escape(self.title)}</caption>" if self.title else ""
        notes = "".join(f"<div>{html.escape(line)}</div>" for line in self.footer)
        return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{notes}"
