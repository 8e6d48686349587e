"""The 02_train stage's result: the training summary as its figures, the run index's headline, the drafter
files that must exist."""

from __future__ import annotations

ARTIFACTS = ["drafter/model.safetensors", "drafter/config.json", "drafter/eagle3.json"]
OVERVIEW = (
    "steps",
    "tokens",
    "train_seconds",
    "train_tokens_per_s",
    "data_wait_s",
    "vocab",
    "world_size",
    "drafter_params",
)


def overview(summary: dict) -> dict:
    """The summary's figures the notebook shows first (the full summary is the stage's result)."""
    return {k: summary[k] for k in OVERVIEW}


def result(summary: dict) -> dict:
    """For Stage.save: the summary of trainer.launch, its final validation's headline figures."""
    ev = summary["eval"]
    headline = {
        "est. accept len @5": ev["est_accept_len"].get("5"),
        "cond_acc[0]": round(ev["cond_acc"][0], 3),
        "train tokens/s": summary["train_tokens_per_s"],
        "tokens": summary["tokens"],
    }
    return {"figures": summary, "headline": headline, "artifacts": ARTIFACTS}
