"""HTML for people: the summary that opens each stage report, the run's index page, static widgets, tables.

The pipeline renders each executed notebook with nbconvert after inserting `stage_summary_html` below its
title; widgets have no kernel in a report, so `static_widgets` swaps each widget for the static HTML shown
with it (see widgets.show) or, for progress bars, for their final state. Everything is self-contained:
no script or style is fetched from the network.
"""

from __future__ import annotations

import html
import json
import re
import time
from pathlib import Path

from eagle3lib import hardware, run_folder
from eagle3lib.workbook.html_pieces import CSS, duration, fmt, table_html

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
REPORT_FILES = {"result.json"}  # besides the stage's own .ipynb/.html, not listed as produced


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _bytes(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


def produced(stage_path: Path, stage: str, limit: int = 24) -> list[dict]:
    """The files and folders a stage left in its folder: [{name, href, size, files, artifact}]."""
    artifacts = (run_folder.read_result(stage_path.parent, stage_path.name) or {}).get("artifacts", [])
    tops = {a.split("/")[0] for a in artifacts}
    out = []
    for p in sorted(stage_path.iterdir()):
        if p.name in REPORT_FILES or p.name.startswith(".") or p.stem == stage or p.name == "screenshots":
            continue
        files = sum(1 for q in p.rglob("*") if q.is_file()) if p.is_dir() else 1
        out.append(
            {
                "name": p.name + ("/" if p.is_dir() else ""),
                "href": p.name + ("/" if p.is_dir() else ""),
                "size": _bytes(_size(p)),
                "files": files,
                "artifact": p.name in tops,
            }
        )
    out.sort(key=lambda x: (not x["artifact"], x["name"]))
    return out[:limit]


# What a reader wants from an engine's log after a stage that worked: how the drafter was loaded and wired, the
# cache and the start-up time (the rest is routes, banners and shutdown chatter). Tracebacks and error lines
# are counted, not shown: an engine that served and stopped cleanly logged exceptions it caught or ignored (vLLM
# prints a long ignored one when its compile cache fails to load); a failed stage shows its own error anyway.
LOG_PATTERNS = (
    "Resolved architecture",
    "drafter",
    "auxiliary layers",
    "embed_tokens",
    "lm_head weights",
    "KV cache size",
    "init engine",
    "Application startup complete",
    "server_args",
    "Load weight end",
)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def log_excerpt(path, patterns=LOG_PATTERNS, max_lines: int = 20, width: int = 220) -> str:
    """The lines of a log that match any pattern (colour codes removed, cut to `width`), at most
    `max_lines` of them, under a line saying where the whole log is and what else it holds."""
    path = Path(path)
    if not path.is_file():
        return f"(no log at {path})"
    lines = ANSI.sub("", path.read_text(errors="replace")).splitlines()

    def error(ln):
        return " ERROR " in ln or ln.startswith("ERROR")

    keep = [
        ln if len(ln) <= width else ln[:width] + " …"
        for ln in lines
        if any(p in ln for p in patterns) and not error(ln)
    ]
    more = f", the first {max_lines} shown" if len(keep) > max_lines else ""
    errors = sum(1 for ln in lines if error(ln))
    tracebacks = sum(1 for ln in lines if ln.startswith("Traceback"))
    also = (
        f"; it also holds {errors} error-level line(s) and {tracebacks} traceback(s), read them there"
        if errors or tracebacks
        else ""
    )
    return "\n".join([f"{path.name}: {len(lines)} lines, {len(keep)} worth reading{more}{also}:"] + keep[:max_lines])


# ---------------------------------------------------------------------------- stage report ----


def stage_summary_html(
    result: dict, stage_path: Path, stage: str, neighbours: tuple = (None, None), error_anchor: str | None = None
) -> str:
    """The box that opens a stage report: links, status and time, headline figures, what the stage made.
    One HTML block without blank lines (it goes into a markdown cell). error_anchor: the id of the element
    just above the cell that failed, if the page has one."""
    prev_stage, next_stage = neighbours
    nav = ["<a href='../index.html'>&uarr; run index</a>"]
    if prev_stage:
        nav.append(f"<a href='../{prev_stage}/{prev_stage}.html'>&larr; {html.escape(prev_stage)}</a>")
    if next_stage:
        nav.append(f"<a href='../{next_stage}/{next_stage}.html'>{html.escape(next_stage)} &rarr;</a>")
    status = result.get("status", "ok")
    if status == "ok":
        state = f"<div class='e3-status e3-ok'>finished in {duration(result.get('seconds'))}</div>"
    else:
        where = f"<a href='#{error_anchor}'>the cell that failed</a>" if error_anchor else "the cell that failed"
        state = (
            f"<div class='e3-status e3-failed'>stage failed after {duration(result.get('seconds'))}: "
            f"{html.escape(str(result.get('error', '')))} ({where} shows the traceback below)</div>"
        )
        if result.get("partial"):
            state += f"<div class='e3-status e3-failed'>{html.escape(kept_text(result['figures']))}</div>"
    cards = "".join(
        f"<div class='e3-card'><div class='k'>{html.escape(str(k))}</div>"
        f"<div class='v'>{html.escape(fmt(v))}</div></div>"
        for k, v in result.get("headline", {}).items()
    )
    items = "".join(
        f"<li><a href='{html.escape(x['href'])}'>{html.escape(x['name'])}</a> "
        f"<span class='e3-dim'>{x['size']}{'' if x['files'] == 1 else ', ' + str(x['files']) + ' files'}"
        f"</span></li>"
        for x in produced(stage_path, stage)
    )
    made = f"<div class='e3-made'><b>Produced</b> (in this folder):<ul>{items}</ul></div>" if items else ""
    return (
        f"<style>{CSS.strip()}</style>\n<div class='e3-summary'><div class='e3-nav'>{' &middot; '.join(nav)}</div>"
        f"{state}<div class='e3-cards'>{cards}</div>{made}</div>"
    ).replace("\n\n", "\n")


def kept_text(figures: dict) -> str:
    """What a stopped stage kept (Stage.save_partial): its measured configurations, and each missing one with why."""
    rows = figures.get("rows", [])
    measured = sorted({r.get("config", "?") for r in rows})
    text = f"Kept in result.json: {len(rows)} rows measured before it stopped ({', '.join(measured) or 'none'})."
    for m in figures.get("missing", []):
        text += f" Missing: {m['config']}, {m['why'].splitlines()[0]}"
    return text


PAPERMILL_ERROR_TAG = "papermill-error-cell-tag"
PAPERMILL_ERROR_ID = "papermill-error-cell"


def drop_papermill_banner(nb) -> str | None:
    """A failed papermill run opens the notebook with a red 'An Exception was encountered' banner linking to a
    marker above the failing cell. The summary says the same, so the banner goes; returns the marker's id
    (or None when there is none) for the summary to link to."""
    nb.cells = [
        c
        for c in nb.cells
        if not (PAPERMILL_ERROR_TAG in c.metadata.get("tags", []) and f'id="{PAPERMILL_ERROR_ID}"' not in c.source)
    ]
    return PAPERMILL_ERROR_ID if any(f'id="{PAPERMILL_ERROR_ID}"' in c.source for c in nb.cells) else None


def insert_summary(nb, summary_html: str) -> None:
    """Put the summary right under the notebook's title: the first markdown cell is split after its
    '# ' line (the rest of the introduction follows the summary)."""
    from nbformat.v4 import new_markdown_cell

    cell = new_markdown_cell(summary_html)
    cell.metadata["tags"] = ["e3-summary"]
    first = nb.cells[0] if nb.cells else None
    if first is not None and first.cell_type == "markdown" and first.source.lstrip().startswith("# "):
        title, _, rest = first.source.lstrip().partition("\n")
        first.source = title
        nb.cells[1:1] = [cell] + ([new_markdown_cell(rest.strip())] if rest.strip() else [])
    else:
        nb.cells.insert(0, cell)


def _progress_html(state: dict, model_id: str) -> str | None:
    """A tqdm-style HBox (texts and a progress bar) in its final state, as static HTML."""
    model = state.get(model_id)
    if not model or model.get("model_name") != "HBoxModel":
        return None
    parts = []
    for ref in model["state"].get("children", []):
        child = state.get(ref.removeprefix("IPY_MODEL_"), {})
        name, s = child.get("model_name", ""), child.get("state", {})
        if name in ("HTMLModel", "LabelModel"):
            value = s.get("value", "")
            parts.append(f"<span>{value if name == 'HTMLModel' else html.escape(value)}</span>")
        elif name in ("FloatProgressModel", "IntProgressModel"):
            parts.append(f"<progress value='{s.get('value', 0)}' max='{s.get('max', 100)}'></progress>")
        else:
            return None
    return f"<div class='e3-progress'>{''.join(parts)}</div>" if parts else None


def static_widgets(nb) -> None:
    """Replace every widget view in the notebook by static output: the text/html shown with it
    (widgets.show), else a progress bar's final state from the saved widget state, else its text.
    The widget state is dropped, so nbconvert never reaches for the widget JavaScript on a CDN."""
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_VIEW not in data:
                continue
            view = data.pop(WIDGET_VIEW)
            if "text/html" not in data:
                static = _progress_html(state, view.get("model_id", ""))
                if static:
                    data["text/html"] = f"<style>{CSS.strip()}</style>{static}"
    nb.metadata.pop("widgets", None)


# ------------------------------------------------------------------------------- run index ----


def _recommendation_html(bench: dict) -> str:
    figures = bench.get("figures", {})
    rec, rows = figures.get("recommendation") or {}, figures.get("rows") or []
    if not rec:
        return ""
    items = []
    for c, r in rec.items():
        spec = [x for x in rows if str(x["concurrency"]) == c and x["depth"]]
        best_spec = max(spec, key=lambda x: x["tokens_per_s"], default=None)
        if r["depth"]:
            text = (
                f"<b>{html.escape(r['config'])}</b>: {fmt(r['tokens_per_s'])} tokens/s, "
                f"<b>{r['speedup']:.2f}x</b> the no-speculation baseline, acceptance length {fmt(r.get('accept_len'))}"
            )
        else:
            text = f"<b>no speculation</b> ({fmt(r['tokens_per_s'])} tokens/s): no depth beat the baseline" + (
                f"; the best, {html.escape(best_spec['config'])}, ran at {best_spec['speedup']:.2f}x with "
                f"acceptance length {fmt(best_spec.get('accept_len'))}"
                if best_spec
                else ""
            )
        cmds = "".join(f"<div>{e}:</div><pre>{html.escape(r[e])}</pre>" for e in ("vllm", "sglang") if r.get(e))
        items.append(
            f"<li>concurrency {html.escape(c)}: {text}<details><summary>launch commands</summary>{cmds}</details></li>"
        )
    return (
        f"<h2>Recommendation</h2><p>The fastest configuration per concurrency "
        f"(<a href='05_benchmark/05_benchmark.html'>benchmark report</a>):</p><ul>{''.join(items)}</ul>"
    )


def _sets_html(bench: dict) -> str:
    """The benchmark's per prompt set table at the lowest concurrency, as the papers print it (rows: sets; a
    column group per depth: AL, predicted AL, speedup)."""
    tables = ((bench.get("figures") or {}).get("sets") or {}).get("tables") or []
    if not tables:
        return ""
    from eagle3lib.workbook import widgets  # ipywidgets: only when there is a table to render

    table = tables[0]
    table = {**table, "sets": [{**s, "cells": {int(d): c for d, c in s["cells"].items()}} for s in table["sets"]]}
    return (
        f"<h2>Per prompt set</h2><p>Acceptance length (AL) measured, as the training stage predicts it on the set's "
        f"own text, and speedup over no speculation, at concurrency {table['concurrency']} "
        f"(<a href='05_benchmark/05_benchmark.html'>all concurrencies, categories and context lengths</a>):</p>"
        + widgets.set_table_html(table)
    )


def index_html(run_dir: Path, stage_names: list[str]) -> str:
    """The run's front page: what ran (status, time, headline figures per stage, linking each report), the
    benchmark's recommendation, the figures, then the params and versions it ran with."""
    import yaml

    run = json.loads((run_dir / "run.json").read_text())
    rows, figures, total, done = [], [], 0.0, 0
    results, failed_before = {}, None
    for stage in stage_names:
        r = run_folder.read_result(run_dir, stage)
        results[stage] = r
        if r is None:
            rows.append(f"<tr><td>{html.escape(stage)}</td><td class='e3-dim'>not run</td><td></td><td></td></tr>")
            continue
        total += r.get("seconds") or 0
        ok = r.get("status") == "ok"
        done += ok and failed_before is None
        if ok:
            figs = "".join(
                f"<div class='e3-card'><div class='k'>{html.escape(str(k))}</div>"
                f"<div class='v'>{html.escape(fmt(v))}</div></div>"
                for k, v in r.get("headline", {}).items()
            )
            figs = f"<div class='e3-cards'>{figs}</div>"
        else:
            figs = f"<div class='e3-failed'>{html.escape(str(r.get('status')))}: {html.escape(str(r.get('error', '')))}</div>"
        link = (
            f"<a href='{stage}/{html.escape(r['report'])}'>{html.escape(stage)}</a>"
            if r.get("report") and (run_dir / stage / r["report"]).is_file()
            else html.escape(stage)
        )
        status = f"<span class='{'e3-ok' if ok else 'e3-failed'}'>{html.escape(str(r.get('status', 'ok')))}</span>"
        if ok and failed_before:  # the run stopped at that failure: this result is an earlier run's
            status = (
                f"<span class='e3-dim' title='not rerun: the run stopped when {html.escape(failed_before)} "
                f"failed'>ok, earlier run</span>"
            )
        if not ok and failed_before is None:
            failed_before = stage
        rows.append(f"<tr><td>{link}</td><td>{status}</td><td>{duration(r.get('seconds'))}</td><td>{figs}</td></tr>")
        for png in sorted((run_dir / stage).glob("*.png")):
            rel = f"{stage}/{png.name}"
            figures.append(
                f"<figure><a href='{rel}'><img src='{rel}' alt='{html.escape(rel)}'></a>"
                f"<figcaption>{html.escape(rel)}</figcaption></figure>"
            )
    bench = results.get("05_benchmark")
    recommendation = _recommendation_html(bench) + _sets_html(bench) if bench and bench.get("status") == "ok" else ""
    git = run.get("git", {})
    versions = table_html([{"package": k, "version": v} for k, v in run.get("versions", {}).items()])
    params = yaml.safe_dump(run.get("params", {}), sort_keys=False)
    started = run.get("started", "")
    machine_text = hardware.describe(run.get("machine") or {})
    status_line = (
        f"all {len(stage_names)} stages finished"
        if done == len(stage_names)
        else f"{done} of {len(stage_names)} stages finished"
    )
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>Run {html.escape(run_dir.name)}</title>
<style>{CSS}
body{{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;max-width:72em;margin:1.5em auto;padding:0 1em;color:#222}}
table.e3-stages{{border-collapse:collapse;width:100%}}table.e3-stages td:nth-child(3){{white-space:nowrap}}table.e3-stages td,table.e3-stages th{{border-bottom:1px solid #ddd;padding:.4em .8em;vertical-align:top;text-align:left}}
.e3-figs{{display:flex;flex-wrap:wrap;gap:1em}}.e3-figs figure{{margin:0;width:22em}}.e3-figs img{{width:100%;border:1px solid #ddd}}
.e3-figs figcaption{{font-size:80%;color:#555}}pre{{background:#f6f8fa;padding:.7em;overflow-x:auto;font-size:85%}}
</style></head><body>
<h1>Run <code>{html.escape(run_dir.name)}</code></h1>
<p>{status_line} &middot; total stage time <b>{duration(total)}</b> &middot; params <code>{html.escape(str(run.get("params_file")))}</code>
&middot; git <code>{html.escape(str(git.get("commit") or "unknown"))[:12]}</code>{" (with uncommitted changes)" if git.get("dirty") else ""}
&middot; machine {html.escape(machine_text)}
&middot; started {html.escape(started)} &middot; index written {time.strftime("%Y-%m-%dT%H:%M:%S%z")}</p>
<h2>Stages</h2>
<table class="e3-stages"><thead><tr><th>stage report</th><th>status</th><th>time</th><th>headline figures</th></tr></thead>
<tbody>{"".join(rows)}</tbody></table>
{recommendation}
{'<h2>Figures</h2><div class="e3-figs">' + "".join(figures) + "</div>" if figures else ""}
<h2>Versions</h2>{versions}
<h2>Params</h2><p>Resolved from <code>{html.escape(str(run.get("params_file")))}</code> with the run's overrides (also in <a href="run.json">run.json</a>):</p>
<pre>{html.escape(params)}</pre>
</body></html>
"""
