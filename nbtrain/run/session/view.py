"""What a session cell shows: its plan, the steps done, each rank's memory and the loss curve so far."""

from __future__ import annotations

import html

from nbtrain.table import TABLE_CSS
from nbtrain.units import format_bytes


def loss_curve_svg(losses: list[float], width: int = 320, height: int = 80) -> str:
    """The losses as an inline SVG line (first step left, last right; lowest loss at the bottom)."""
    if len(losses) < 2:
        return ""
    low, high = min(losses), max(losses)
    span = (high - low) or 1.0
    points = " ".join(f"{i * (width - 8) / (len(losses) - 1) + 4:.1f},{height - 4 - (v - low) / span * (height - 8):.1f}"
                      for i, v in enumerate(losses))
    return (f'<svg width="{width}" height="{height}" role="img" aria-label="training loss, {len(losses)} steps">'
            f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{points}"/></svg>')


def session_html(session) -> str:
    """The session as one HTML block."""
    rows = [("plan", str(session.plan)), ("processes", str(session.num_processes)),
            ("state", "open" if session.alive else "closed"), ("steps done", str(session.steps_done))]
    if session.records:
        rows.append(("last loss", f"{session.records[-1].loss:.4f}"))
    if session.materialized:
        rows.append(("memory per rank (model in place)", " · ".join(format_bytes(m) for m in session.materialized)))
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    curve = loss_curve_svg([r.loss for r in session.records])
    return f'<style>{TABLE_CSS}</style><table class="nbtrain-table">{body}</table>{curve}'
