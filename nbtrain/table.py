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

TABLE_CSS = (
    "table.nbtrain-table{table-layout:auto;border-collapse:collapse;margin:0.4em 0;border:none;"
    "font-variant-numeric:tabular-nums}"
    "table.nbtrain-table caption{text-align:left;font-weight:600;padding:0 0 0.3em 0}"
    "table.nbtrain-table th,table.nbtrain-table td{padding:0.25em 0.8em;border:none;vertical-align:top}"
    "table.nbtrain-table th{white-space:nowrap;font-weight:600;border-bottom:1px solid currentColor}"
    "table.nbtrain-table td.r{white-space:nowrap}"
    "table.nbtrain-table tbody tr:nth-child(even){background:rgba(127,127,127,0.09)}"
    "table.nbtrain-table tr.rule td{border-top:1px solid rgba(127,127,127,0.6)}"
    ".nbtrain-notes{font-size:90%;margin:0.2em 0 0.6em 0}"
)
"""How every nbtrain table looks in HTML, wherever it is shown: a static output, the plan explorer's widgets (which
sit outside the notebook's own table style) or an exported page. A header rule, light stripes, numbers that never
wrap ("2.32 GiB" stays on one line) and headers that never break."""



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
        """The table in HTML with its own style (``TABLE_CSS``), so it looks the same in every place it is shown."""

        def cell(tag: str, text: str, i: int) -> str:
            side = self._align(i)
            style = "left" if side == "l" else "right"
            return f'<{tag} class="{side}" style="text-align:{style}">{html.escape(text)}</{tag}>'

        head = "".join(cell("th", h, i) for i, h in enumerate(self.header))
        body, rule = [], False
        for row in self.rows:
            if not row:
                rule = True
                continue
            cells = "".join(cell("td", c, i) for i, c in enumerate(row))
            body.append(f'<tr class="rule">{cells}</tr>' if rule else f"<tr>{cells}</tr>")
            rule = False
        caption = f"<caption>{html.escape(self.title)}</caption>" if self.title else ""
        notes = "".join(f"<div>{html.escape(line)}</div>" for line in self.footer)
        notes = f'<div class="nbtrain-notes">{notes}</div>' if notes else ""
        return (f'<style>{TABLE_CSS}</style><table class="nbtrain-table">{caption}<thead><tr>{head}</tr></thead>'
                f"<tbody>{''.join(body)}</tbody></table>{notes}")
