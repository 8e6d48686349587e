"""matplotlib figures shared by the notebooks and the reports."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg") if not matplotlib.get_backend().lower().startswith(("module://", "inline")) else None
import matplotlib.pyplot as plt  # noqa: E402


def show(fig, path: str | Path | None = None, dpi: int = 110) -> None:
    """Save the figure (when a path is given), display it once and close it: a notebook's inline backend
    would otherwise show a displayed figure a second time at the end of the cell."""
    from IPython.display import display

    if path is not None:
        fig.savefig(path, dpi=dpi)
    display(fig)
    plt.close(fig)


def read_log(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(train entries, eval entries) of a training log.jsonl."""
    train, evals = [], []
    for line in Path(path).read_text().splitlines():
        entry = json.loads(line)
        (evals if "eval" in entry else train).append(entry)
    return train, evals


def _finished(fig, ax, **legend):
    """How the figures here end: a light grid, the legend, a tight layout."""
    ax.grid(alpha=0.3)
    ax.legend(**legend)
    fig.tight_layout()
    return fig


def loss_curve(train_entries: list[dict], eval_entries: list[dict]):
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(
        [e["step"] for e in train_entries],
        [e["loss"] for e in train_entries],
        lw=0.8,
        label="train (weighted TTT loss)",
    )
    if eval_entries:
        ax.plot(
            [e["step"] for e in eval_entries],
            [
                sum(w * loss for w, loss in zip(_weights(len(e["eval"]["loss_per_step"])), e["eval"]["loss_per_step"]))
                for e in eval_entries
            ],
            "o-",
            label="validation",
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _weights(k, decay=0.8):
    return [decay**i for i in range(k)]


def acceptance_vs_depth(summary: dict, title: str = ""):
    """Per-step and conditional accuracy per draft position, and the estimated acceptance
    length of a chain of each depth (extrapolated depths dashed)."""
    steps = len(summary["step_acc"])
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    pos = list(range(1, steps + 1))
    ax.plot(pos, summary["step_acc"], "o-", label="step_acc[k]")
    ax.plot(pos, summary["cond_acc"], "s-", label="cond_acc[k]")
    ax.plot(pos, summary["joint_acc"], "^-", label="joint_acc[k]")
    ax.set_xlabel("speculative depth (draft position)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    est = {int(d): v for d, v in summary["est_accept_len"].items()}
    depths = sorted(est)
    ax2 = ax.twinx()
    trained = [d for d in depths if d <= steps]
    extra = [d for d in depths if d >= steps]
    ax2.plot(trained, [est[d] for d in trained], "k-", lw=2, label="est. acceptance length")
    if len(extra) > 1:
        ax2.plot(extra, [est[d] for d in extra], "k--", lw=1.5, label="… extrapolated")
    ax2.set_ylabel("estimated acceptance length")
    ax2.set_ylim(1, max(est.values()) * 1.1)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    # Below the axes: inside, it hides points wherever it goes.
    ax.legend(
        lines[0] + lines2[0],
        lines[1] + lines2[1],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        ncol=3,
        fontsize=8,
        frameon=False,
    )
    ax.set_xlim(0.5, max(depths) + 0.5)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


# ---- 05_benchmark ------------------------------------------------------------------------------


def bench_throughput(rows: list[dict]):
    """Output tokens/s versus speculative depth, one line per concurrency, the baseline as a dashed line."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, c in enumerate(sorted({r["concurrency"] for r in rows})):
        color = f"C{i}"
        spec = sorted((r for r in rows if r["concurrency"] == c and r["depth"]), key=lambda r: r["depth"])
        base = [r for r in rows if r["concurrency"] == c and not r["depth"]]
        ax.plot(
            [r["depth"] for r in spec],
            [r["tokens_per_s"] for r in spec],
            "o-",
            color=color,
            label=f"EAGLE-3, concurrency {c}",
        )
        if base:
            ax.axhline(base[0]["tokens_per_s"], color=color, ls="--", lw=1, label=f"no speculation, concurrency {c}")
    ax.set_xlabel("speculative depth (draft tokens per step)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(0, 1.15 * max(r["tokens_per_s"] for r in rows))
    ax.set_xticks(sorted({r["depth"] for r in rows if r["depth"]}))
    return _finished(fig, ax, fontsize=8)


def bench_speedup_model(cost_model: dict | None, rows: list[dict]):
    """The measured speedups over depth per concurrency as points (hollow: fewer prompts), no speculation at 1.0,
    and, when the sweep ran the cost model, its predicted curves (calibrated: solid; before calibration: dotted)."""
    cost_model = cost_model or {"predicted": [], "predicted_before_calibration": []}
    fig, ax = plt.subplots(figsize=(7, 3.8))
    full = max(r.get("prompts", 0) for r in rows)
    for i, c in enumerate(sorted({r["concurrency"] for r in rows})):
        color = f"C{i}"
        for key, style, label in (
            ("predicted", "-", "predicted"),
            ("predicted_before_calibration", ":", "before calibration"),
        ):
            curve = sorted((r for r in cost_model[key] if r["concurrency"] == c), key=lambda r: r["depth"])
            ax.plot(
                [r["depth"] for r in curve],
                [r["speedup"] for r in curve],
                style,
                color=color,
                lw=1.5 - 0.5 * (style == ":"),
                label=f"{label}, concurrency {c}",
            )
        spec = [r for r in rows if r["concurrency"] == c and r["depth"]]
        for quick in (False, True):
            pts = [r for r in spec if (r.get("prompts", full) < full) == quick]
            ax.plot(
                [r["depth"] for r in pts],
                [r["speedup"] for r in pts],
                "o",
                color=color,
                mfc="none" if quick else color,
                label=f"measured, concurrency {c}" + (" (fewer prompts)" if quick else "") if pts else None,
            )
    ax.axhline(1.0, color="k", ls="--", lw=1, label="no speculation")
    ax.set_xlabel("speculative depth (draft tokens per step)")
    ax.set_ylabel("speedup over no speculation")
    ax.set_ylim(0, 1.15 * max([1.0] + [r["speedup"] for r in rows] + [r["speedup"] for r in cost_model["predicted"]]))
    return _finished(fig, ax, fontsize=7, ncol=2)


def bench_acceptance(rows: list[dict]):
    """Acceptance length versus depth: measured per concurrency and predicted from training."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    spec = [r for r in rows if r["depth"]]
    for i, c in enumerate(sorted({r["concurrency"] for r in spec})):
        pts = sorted((r for r in spec if r["concurrency"] == c and r.get("accept_len")), key=lambda r: r["depth"])
        ax.plot(
            [r["depth"] for r in pts],
            [r["accept_len"] for r in pts],
            "o-",
            color=f"C{i}",
            label=f"measured, concurrency {c}",
        )
    pred = sorted({r["depth"]: r["predicted_accept_len"] for r in spec if r.get("predicted_accept_len")}.items())
    if pred:
        ax.plot([d for d, _ in pred], [v for _, v in pred], "k^--", label="predicted (training cond_acc)")
    ax.axhline(1, color="grey", lw=0.8)
    ax.set_xticks(sorted({r["depth"] for r in spec}))
    ax.set_xlabel("speculative depth")
    ax.set_ylabel("acceptance length (tokens per target step)")
    return _finished(fig, ax, fontsize=8)


def _by_position(ax, values, fmt: str, **style) -> None:
    """One series over draft positions 1..len(values)."""
    ax.plot(range(1, len(values) + 1), values, fmt, **style)


def bench_per_position(rows: list[dict], eval_summary: dict | None = None):
    """Per-position acceptance (engine: accepted at position k / drafts = joint_acc[k]) per depth, against
    training's joint_acc (predicted, extrapolated past the trained steps) and step_acc."""
    fig, ax = plt.subplots(figsize=(7.5, 4))
    spec = [r for r in rows if r["depth"] and r.get("per_pos")]
    c0 = min((r["concurrency"] for r in spec), default=None)
    for i, r in enumerate(sorted((r for r in spec if r["concurrency"] == c0), key=lambda r: -r["depth"])):
        _by_position(
            ax, r["per_pos"], "o-", color=f"C{i}", ms=4, label=f"measured, depth {r['depth']} (concurrency {c0})"
        )
    longest = max((r for r in rows if r.get("predicted_per_pos")), key=lambda r: r["depth"], default=None)
    if longest:
        _by_position(ax, longest["predicted_per_pos"], "k--", label="predicted joint_acc (training)")
    if eval_summary:
        _by_position(ax, eval_summary["step_acc"], "s:", color="grey", label="training step_acc")
    ax.set_xlabel("draft position")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("acceptance (share of drafts)")
    ax.set_ylim(0, 1)
    return _finished(fig, ax, fontsize=8)


def bench_context(context: list[dict]):
    """Acceptance length against prompt length: one line per depth over the context-length buckets
    (bench.per_set.context_table), at each bucket's mean prompt length."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    depths = sorted({d for g in context for d in g["cells"]})
    for i, d in enumerate(depths):
        pts = [g["cells"][d] for g in context if d in g["cells"] and g["cells"][d].get("accept_len")]
        ax.plot(
            [c["mean_prompt_tokens"] for c in pts], [c["accept_len"] for c in pts], "o-", color=f"C{i}",
            label=f"depth {d}",
        )  # fmt: skip
        for c in pts:
            ax.annotate(f"{c['requests']}", (c["mean_prompt_tokens"], c["accept_len"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))  # fmt: skip
    ax.set_xscale("log")
    ax.axhline(1, color="grey", lw=0.8)
    ax.set_xlabel("prompt length (tokens, mean of the bucket; labels: requests)")
    ax.set_ylabel("acceptance length")
    return _finished(fig, ax, fontsize=8)


def load_curves(load_rows: list[dict]):
    """Output tokens/s and p90 inter-token latency at each load point (closed loop at each concurrency, then the
    Poisson rates), one line per configuration; the depth schedule drawn thick."""
    order = sorted({(r["rate"] is not None, r["rate"] or 0.0, r["concurrency"] or 0, r["load"]) for r in load_rows})
    x = {key[-1]: i for i, key in enumerate(order)}
    fig, (speed, latency) = plt.subplots(1, 2, figsize=(10, 3.8))
    if not load_rows:
        speed.text(0.5, 0.5, "no serving load measured (bench.load_prompts: 0)", ha="center", transform=speed.transAxes)
    for config in dict.fromkeys(r["config"] for r in load_rows):
        mine = sorted((r for r in load_rows if r["config"] == config), key=lambda r: x[r["load"]])
        style = {"lw": 3} if mine[0].get("schedule") else {"ls": "--"} if config.startswith("baseline") else {}
        xs = [x[r["load"]] for r in mine]
        speed.plot(xs, [r["tokens_per_s"] for r in mine], "o-", label=config, **style)
        latency.plot(xs, [r.get("p90_itl_ms") for r in mine], "o-", label=config, **style)
    for ax, label in ((speed, "output tokens/s"), (latency, "p90 inter-token latency (ms)")):
        ax.set_xticks(range(len(order)), [key[-1] for key in order], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    if load_rows:
        speed.legend(fontsize=8)
    fig.tight_layout()
    return fig
