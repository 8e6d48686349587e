"""Widgets for JupyterLab where looking beats reading, each with a static rendering for the HTML reports.

A builder returns an ipywidgets box: controls above an `HTML` widget that is re-rendered when a control
changes (an HTML widget rather than an Output one, so it behaves the same in JupyterLab, under papermill
and in tests). `show(widget, static_html)` puts both in one output: JupyterLab renders the widget, the
report (nbconvert; the pipeline drops the widget state, eagle3lib.workbook.report.static_widgets) the static HTML.
"""

from __future__ import annotations

import base64
import html
import io

import ipywidgets as W

from eagle3lib.speedup import recommend
from eagle3lib.speedup.replay import TARGET
from eagle3lib.workbook import html_pieces, plots

STYLE = (
    f"<style>{html_pieces.CSS.strip()}"
    + """
.e3-tokens{white-space:pre-wrap;font-family:system-ui,sans-serif;line-height:1.7;border:1px solid #ddd;
 border-radius:4px;padding:.5em .7em;background:#fff;max-height:32em;overflow-y:auto}
.e3-tok{border-radius:3px;padding:.05em 0;border-right:1px solid #fff}
.e3-two{display:grid;grid-template-columns:1fr 1fr;gap:1em}.e3-two h4{margin:.3em 0}
.e3-prompt{font-size:90%;color:#333;background:#f6f8fa;border-left:3px solid #c9d3df;padding:.4em .7em;
 white-space:pre-wrap;max-height:9em;overflow-y:auto}
.e3-legend{font-size:85%;margin:.4em 0}.e3-legend span{display:inline-block;margin:0 .3em .2em 0;padding:0 .4em}
.e3-side{display:flex;flex-wrap:wrap;gap:1.5em;align-items:flex-start}
</style>"""
)


# ------------------------------------------------------------------------------- plumbing ----


def bundle(widget, static_html: str) -> dict:
    """The widget's display data plus a static text/html rendering (shown where widgets cannot run)."""
    data = dict(widget._repr_mimebundle_() or {})
    data["text/html"] = static_html
    return data


def show(widget, static_html: str) -> None:
    from IPython.display import display

    display(bundle(widget, static_html), raw=True)


def figure_html(fig, dpi: int = 100) -> str:
    """A matplotlib figure as an inline PNG <img> (closed afterwards, so the notebook does not show it twice)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plots.plt.close(fig)
    return f"<img alt='figure' src='data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}'>"


# ------------------------------------------------------------------------------- training ----


def training_evals(log_path, initial: dict | None = None) -> list[dict]:
    """[{step, eval}] of every validation in a training log.jsonl; `initial` (the evaluation before training)
    becomes step 0 unless the log has one."""
    _, evals = plots.read_log(log_path)
    out = [{"step": e["step"], "eval": e["eval"]} for e in evals]
    if initial and not any(e["step"] == 0 for e in out):
        out.insert(0, {"step": 0, "eval": initial})
    return out


def per_position_rows(ev: dict) -> list[dict]:
    """One validation's accuracy per draft position, a row per position."""
    return [
        {
            "position": k + 1,
            "step_acc": ev["step_acc"][k],
            "cond_acc": ev["cond_acc"][k],
            "joint_acc": ev["joint_acc"][k],
        }
        for k in range(len(ev["step_acc"]))
    ]


def est_accept_len_at(ev: dict, depths=(1, 3, 5, 7, 10, 16)) -> dict:
    """{"depth d": estimated acceptance length} at those of `depths` the validation has; depths beyond the
    trained steps are marked extrapolated."""
    extra = set(ev.get("extrapolated_depths", []))
    shown = sorted({int(d) for d in ev["est_accept_len"]} & set(depths))
    return {f"depth {d}" + (" (extrapolated)" if d in extra else ""): ev["est_accept_len"][str(d)] for d in shown}


def accuracy_html(ev: dict, title: str = "") -> str:
    """One validation: the accuracy-versus-depth figure, the per-position table and the estimated
    acceptance length per depth (extrapolated depths marked)."""
    per_pos = per_position_rows(ev)
    extra = set(ev.get("extrapolated_depths", []))
    est = [
        {"depth": int(d), "est. acceptance length": v, "": "extrapolated" if int(d) in extra else ""}
        for d, v in sorted(ev["est_accept_len"].items(), key=lambda x: int(x[0]))
    ]
    fig = figure_html(plots.acceptance_vs_depth(ev, title))
    return (
        f"{STYLE}<div class='e3-side'><div>{fig}</div><div>{html_pieces.table_html(per_pos)}</div>"
        f"<div>{html_pieces.table_html(est)}</div></div>"
    )


def evals_table_html(evals: list[dict], depths=(1, 3, 5, 7, 10, 16)) -> str:
    """Every validation in one table: accuracy per position and estimated acceptance length per depth."""
    rows = []
    for e in evals:
        ev = e["eval"]
        row = {
            "step": e["step"],
            "positions": ev.get("positions"),
            "step_acc by position": " ".join(f"{x:.3f}" for x in ev["step_acc"]),
            "cond_acc by position": " ".join(f"{x:.3f}" for x in ev["cond_acc"]),
        }
        for d in depths:
            if str(d) in ev["est_accept_len"]:
                row[f"est. len @{d}"] = ev["est_accept_len"][str(d)]
        rows.append(row)
    return (
        f"{STYLE}<p>Each validation during training (step 0: before training); est. len = estimated "
        f"acceptance length 1 + &Sigma; joint_acc for a chain of that depth.</p>{html_pieces.table_html(rows)}"
    )


def accuracy_explorer(evals: list[dict]) -> W.VBox:
    """A slider over the validation checkpoints; shows that validation's accuracy per depth."""
    if not evals:
        raise ValueError(
            "Expected at least one validation in the training log, found none; "
            "lower train.eval_every or check the log.jsonl."
        )
    labels = [("before training" if e["step"] == 0 else f"step {e['step']}", i) for i, e in enumerate(evals)]
    slider = W.SelectionSlider(
        options=labels,
        value=len(evals) - 1,
        description="validation at",
        continuous_update=False,
        layout=W.Layout(width="36em"),
        style={"description_width": "initial"},
    )
    view = W.HTML()

    def render(_=None):
        e = evals[slider.value]
        view.value = accuracy_html(e["eval"], f"validation, {labels[slider.value][0]}")

    slider.observe(render, names="value")
    render()
    return W.VBox([slider, view])


# ------------------------------------------------------------------------------ benchmark ----


def source_colour(k: int, depth: int) -> tuple[str, str]:
    """(background, text) colour of a token accepted at draft position k of `depth` (k = 0: the target's)."""
    if k == TARGET:
        return "#e9e9e9", "#222"
    cmap = plots.plt.get_cmap("YlGnBu")
    r, g, b, _ = cmap(0.18 + 0.72 * (k - 1) / max(depth - 1, 1))
    text = "#fff" if 0.299 * r + 0.587 * g + 0.114 * b < 0.55 else "#111"
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}", text


def tokens_html(pieces: list[str], source: list[int] | None = None, depth: int = 1) -> str:
    """The text token by token, each coloured by its source (no colours without one)."""
    spans = []
    for i, piece in enumerate(pieces):
        text = html.escape(piece).replace("\n", "&#8629;\n")
        if source is None:
            spans.append(text)
            continue
        k = source[i]
        bg, fg = source_colour(k, depth)
        title = "from the target (prefill or verification)" if k == TARGET else f"draft token accepted at position {k}"
        spans.append(f"<span class='e3-tok' style='background:{bg};color:{fg}' title='{title}'>{text}</span>")
    return f"<div class='e3-tokens'>{''.join(spans)}</div>"


def legend_html(depth: int) -> str:
    bg, fg = source_colour(TARGET, depth)
    items = [f"<span style='background:{bg};color:{fg}'>target</span>"]
    for k in range(1, depth + 1):
        bg, fg = source_colour(k, depth)
        items.append(f"<span style='background:{bg};color:{fg}'>{k}</span>")
    return (
        f"<div class='e3-legend'>Each token: <b>target</b> = the target's own token (prefill, or the one it adds "
        f"after the accepted drafts at each verification); <b>k</b> = a draft token accepted at chain position k. "
        f"{''.join(items)} &#8629; = newline</div>"
    )


def provenance_html(record: dict, depth: int) -> str:
    """One prompt at one depth: the replayed output coloured by source beside the no-speculation output."""
    r = record["replays"][str(depth)]
    drafted = sum(1 for s in r["source"] if s != TARGET)
    left = (
        f"<h4>EAGLE-3, depth {depth}: acceptance length {html_pieces.fmt(r['accept_len'])}</h4>"
        f"<div class='e3-dim'>{r['rounds']} verify steps; {drafted} of {len(r['token_ids'])} tokens were accepted "
        f"drafts</div>{tokens_html(r['pieces'], r['source'], depth)}"
    )
    base = record.get("baseline")
    if base:
        if r["token_ids"] == base["token_ids"]:
            same = "identical to the replay, token for token"
        else:
            k = next(
                (i for i, (a, b) in enumerate(zip(r["token_ids"], base["token_ids"])) if a != b),
                min(len(r["token_ids"]), len(base["token_ids"])),
            )
            same = f"<span class='e3-failed'>differs from the replay from token {k} on</span>"
        right = (
            f"<h4>No speculation (the engine's baseline)</h4><div class='e3-dim'>{same}</div>"
            f"{tokens_html(base['pieces'])}"
        )
    else:
        right = "<h4>No speculation</h4><p class='e3-dim'>(no baseline output recorded)</p>"
    prompt = html.escape(record["prompt"][:1500] + ("…" if len(record["prompt"]) > 1500 else ""))
    return (
        f"{STYLE}<div><b>Prompt</b> <span class='e3-dim'>{html.escape(str(record['id']))}</span>"
        f"<div class='e3-prompt'>{prompt}</div></div>{legend_html(depth)}"
        f"<div class='e3-two'><div>{left}</div><div>{right}</div></div>"
    )


def default_depth(prov: dict, recommendation: dict | None = None) -> int:
    """The recommended depth at the lowest concurrency when speculation won there, else the deepest chain."""
    rec = recommendation or {}
    if rec:
        first = rec[min(rec, key=int)]
        if first.get("depth") in prov["depths"]:
            return first["depth"]
    return max(prov["depths"])


def showcase_prompt(prov: dict, depth: int) -> int:
    """The prompt whose replay at `depth` took the most tokens from drafts (the first of equals): the one a
    static report shows, where the colours say the most."""
    drafted = [sum(1 for s in p["replays"][str(depth)]["source"] if s != TARGET) for p in prov["prompts"]]
    return max(range(len(drafted)), key=lambda i: (drafted[i], -i))


def provenance_explorer(prov: dict, depth: int | None = None, prompt_index: int = 0) -> W.VBox:
    """Pick a prompt and a depth; see the output coloured by how each token came, beside the baseline."""
    if not prov["prompts"]:
        raise ValueError("Expected replayed prompts in the provenance record, found none.")
    labels = [(f"{i + 1}. {' '.join(p['prompt'].split())[:70]}", i) for i, p in enumerate(prov["prompts"])]
    prompt = W.Dropdown(options=labels, value=prompt_index, description="prompt", layout=W.Layout(width="48em"))
    depths = W.ToggleButtons(
        options=[(str(d), d) for d in prov["depths"]],
        value=depth or max(prov["depths"]),
        description="depth",
        style={"button_width": "4em"},
    )
    view = W.HTML()

    def render(_=None):
        view.value = provenance_html(prov["prompts"][prompt.value], depths.value)

    prompt.observe(render, names="value")
    depths.observe(render, names="value")
    render()
    return W.VBox([W.HBox([prompt]), depths, view])


def provenance_table_html(prov: dict, rows: list[dict]) -> str:
    """Per depth: the replay's acceptance against the engine's measured and the training's predicted one."""
    from eagle3lib.speedup.replay import compare_with_engine

    return f"{STYLE}{html_pieces.table_html(compare_with_engine(prov, rows))}"


def speed_html(rows: list[dict], concurrency: int, recommendation: dict | None = None) -> str:
    """The sweep's rows at one concurrency, with the recommendation for it."""
    sel = [r for r in rows if r["concurrency"] == concurrency]
    rec = (recommendation or {}).get(str(concurrency))
    line = ""
    if rec:
        line = (
            f"<p>Fastest at concurrency {concurrency}: <b>{html.escape(rec['config'])}</b>, "
            f"{html_pieces.fmt(rec['tokens_per_s'])} tokens/s ({html_pieces.fmt(rec['speedup'])}x the baseline).</p>"
        )
    return f"{STYLE}{html_pieces.table_html(recommend.table(sel))}{line}"


def speed_explorer(rows: list[dict], recommendation: dict | None = None) -> W.VBox:
    """Pick a concurrency; see every configuration's speed, acceptance and losslessness at it."""
    levels = sorted({r["concurrency"] for r in rows})
    if not levels:
        raise ValueError("Expected benchmark rows, found none.")
    pick = W.ToggleButtons(
        options=[(str(c), c) for c in levels],
        value=levels[0],
        description="concurrency",
        style={"description_width": "initial"},
    )
    view = W.HTML()

    def render(_=None):
        view.value = speed_html(rows, pick.value, recommendation)

    pick.observe(render, names="value")
    render()
    return W.VBox([pick, view])


def speed_static_html(rows: list[dict], recommendation: dict | None = None) -> str:
    """Every concurrency's table, one after the other (the report cannot offer a control)."""
    parts = [
        f"<h4>concurrency {c}</h4>{speed_html(rows, c, recommendation)}"
        for c in sorted({r["concurrency"] for r in rows})
    ]
    return "".join(parts)


# ------------------------------------------------------------------------ per prompt set ----


def _al(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def set_table_html(table: dict) -> str:
    """bench.per_set.set_table as the papers print it: a row per set, a column group per depth with the
    measured acceptance length (AL), the training stage's prediction on the set's own text and the speedup."""
    depths = table["depths"]
    predicted = any(c.get("predicted_accept_len") for s in table["sets"] for c in s["cells"].values())
    sub = ["AL", "predicted AL", "speedup"] if predicted else ["AL", "speedup"]
    top = "<th rowspan=2>set</th><th rowspan=2>prompts</th><th rowspan=2>baseline tokens/s</th>" + "".join(
        f"<th colspan={len(sub)}>depth {d}</th>" for d in depths
    )
    second = "".join(f"<th>{h}</th>" for _ in depths for h in sub)
    body = []
    for s in table["sets"]:
        cells = []
        for d in depths:
            c = s["cells"].get(d, {})
            speed = "–" if c.get("speedup") is None else f"{c['speedup']:.2f}x"
            vals = [_al(c.get("accept_len"))] + ([_al(c.get("predicted_accept_len"))] if predicted else []) + [speed]
            cells += vals
        body.append(
            f"<tr><td>{html.escape(s['set'])}</td><td>{s['prompts']}</td><td>{s['baseline_tokens_per_s']:.1f}</td>"
            + "".join(f"<td>{v}</td>" for v in cells)
            + "</tr>"
        )
    cap = f"<caption>concurrency {table['concurrency']}</caption>"
    return (
        f"{STYLE}<table class='e3-table'>{cap}<thead><tr>{top}</tr><tr>{second}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table>"
    )


def set_tables_html(tables: list[dict]) -> str:
    """set_table_html of every concurrency, one after the other."""
    return "".join(set_table_html(t) for t in tables)


def grouped_acceptance_html(groups: list[dict], title: str) -> str:
    """bench.per_set.category_table or context_table: a row per group, acceptance length (requests) per depth."""
    depths = sorted({d for g in groups for d in g["cells"]})
    records = []
    for g in groups:
        label = " / ".join(g["group"]) if isinstance(g["group"], (list, tuple)) else g["group"]
        rec = {title: label}
        first = next(iter(g["cells"].values()), {})
        if "mean_prompt_tokens" in first:
            rec["mean prompt tokens"] = round(first["mean_prompt_tokens"])
        rec["requests"] = first.get("requests")
        for d in depths:
            rec[f"AL depth {d}"] = _al(g["cells"].get(d, {}).get("accept_len"))
        records.append(rec)
    return STYLE + html_pieces.table_html(records)
