"""The HTML pieces every report and widget is made of: the shared CSS, figures formatted for a reader, record
tables."""

from __future__ import annotations

import html

CSS = """
.e3-summary{border:1px solid #c9d3df;border-radius:6px;background:#f7f9fc;padding:.8em 1.1em;margin:.6em 0 1.2em}
.e3-nav{font-size:90%;margin-bottom:.5em}.e3-nav a{text-decoration:none}
.e3-status{font-weight:600;margin:.2em 0 .6em}.e3-ok{color:#17692c}.e3-failed{color:#a4161a}
.e3-cards{display:flex;flex-wrap:wrap;gap:.6em;margin:.4em 0 .8em}
.e3-card{background:#fff;border:1px solid #dde3ea;border-radius:5px;padding:.35em .8em;min-width:8em}
.e3-card .k{font-size:80%;color:#555}.e3-card .v{font-size:135%;font-weight:600}
.e3-made{font-size:92%}.e3-made ul{margin:.2em 0;columns:2}.e3-made li{break-inside:avoid}
.e3-dim{color:#666}
table.e3-table{border-collapse:collapse;font-size:90%;margin:.4em 0}
table.e3-table th,table.e3-table td{border-bottom:1px solid #ddd;padding:.2em .7em;text-align:right;vertical-align:top}
table.e3-table th{background:#f0f3f7}
table.e3-table td:first-child,table.e3-table th:first-child{text-align:left}
.e3-progress{display:flex;align-items:center;gap:.6em;font-family:monospace;font-size:85%;color:#444}
.e3-progress progress{width:16em}
"""


# --------------------------------------------------------------------------------- pieces ----


def fmt(value) -> str:
    """A figure as a reader wants it: None as a dash, floats to 4 significant digits, ints grouped."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
    return str(value)


def duration(seconds) -> str:
    if seconds is None:
        return "–"
    seconds = float(seconds)
    if seconds < 90:
        return f"{seconds:.1f} s"
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s" if m < 60 else f"{m // 60} h {m % 60:02d} min"


def table_html(records: list[dict], caption: str | None = None) -> str:
    """An HTML table of records (dicts with the same keys), values through fmt."""
    if not records:
        return "<p class='e3-dim'>(no rows)</p>"
    keys = list(records[0])
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in keys)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(fmt(r.get(k)))}</td>" for k in keys) + "</tr>" for r in records)
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    return f"<table class='e3-table'>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
