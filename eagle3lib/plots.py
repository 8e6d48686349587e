"""matplotlib figures shared by the notebooks and the reports."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg") if not matplotlib.get_backend().lower().startswith(("module://", "inline")) else None
import matplotlib.pyplot as plt  # noqa: E402


def read_log(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(train entries, eval entries) of a training log.jsonl."""
    train, evals = [], []
    for line in Path(path).read_text().splitlines():
        entry = json.loads(line)
        (evals if "eval" in entry else train).append(entry)
    return train, evals


def loss_curve(train_entries: list[dict], eval_entries: list[dict]):
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([e["step"] for e in train_entries], [e["loss"] for e in train_entries], lw=0.8, label="train (weighted TTT loss)")
    if eval_entries:
        ax.plot([e["step"] for e in eval_entries],
                [sum(w * l for w, l in zip(_weights(len(e["eval"]["loss_per_step"])), e["eval"]["loss_per_step"]))
                 for e in eval_entries], "o-", label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _weights(k, decay=0.8):
    return [decay ** i for i in range(k)]


def acceptance_vs_depth(summary: dict, title: str = ""):
    """Per-step and conditional accuracy per draft position, and the estimated acceptance
    length of a chain of each depth (extrapolated depths dashed)."""
    steps = len(summary["step_acc"])
    fig, ax = plt.subplots(figsize=(7.5, 4))
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
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="center right", fontsize=8)
    ax.set_xlim(0.5, max(depths) + 0.5)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig
