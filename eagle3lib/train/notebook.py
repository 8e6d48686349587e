"""The 02_train stage's result: the training summary as its figures, the run index's headline, the drafter
files that must exist; online mode's plan, which 00_prepare prints beside 01_extract's."""

from __future__ import annotations

from pathlib import Path

from eagle3lib import run_folder
from eagle3lib.train import sources

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


def fine_tune_text(summary: dict) -> str:
    """With train.init_from: the estimated acceptance length per depth of the drafter it started from and of the
    fine-tuned one, on this run's validation rows; without it, what the untrained drafter was."""
    before, after = summary.get("initial_eval"), summary["eval"]
    warm = (summary.get("vocab") or {}).get("warm_start")
    if not before:
        return "no evaluation before training (a resumed run's first one was its earlier start's)"
    depths = [d for d in ("1", "2", "3", "5", "10", "16") if d in after["est_accept_len"]]
    pairs = ", ".join(f"@{d} {before['est_accept_len'][d]:.2f} -> {after['est_accept_len'][d]:.2f}" for d in depths)
    start = f"started from {warm['init_from']}" if warm else "started untrained"
    text = f"{start}; estimated acceptance length on this run's validation, before -> after training: {pairs}"
    if (kept := kept_text(summary)) is not None:
        text += f"\n{kept}"
    if warm and (verdict := fine_tune_verdict(before, after, summary["tokens"])):
        text += f"\n{verdict}"
    return text


def kept_text(summary: dict) -> str | None:
    """With train.keep_best_at: which evaluated state the drafter written is, and the last one's figure."""
    kept = summary.get("kept") or {}
    if kept.get("rule", "last") == "last":
        return None
    start = " (the drafter it started from)" if kept["step"] == 0 else ""
    return (
        f"drafter kept: step {kept['step']}{start}, the {kept['rule']} ({kept['est_accept_len']:.3f}); the last "
        f"state, step {kept['last_step']}, had {kept['last_est_accept_len']:.3f} (train.keep_best_at)"
    )


DEMONSTRATION_GAIN = 0.01  # a fine-tune that moves est. AL@5 by less than 1% shows the stage, not a better drafter


def fine_tune_verdict(before: dict, after: dict, tokens: int) -> str | None:
    """What a fine-tune from a released drafter was for, by what it did to est. AL@5: None when it raised it by
    DEMONSTRATION_GAIN or more; else that it demonstrated the stage (3 CPU minutes moved the released
    drafter by +0.3%), and what would move it."""
    was, now = before["est_accept_len"].get("5"), after["est_accept_len"].get("5")
    if not was or not now or now / was - 1 >= DEMONSTRATION_GAIN:
        return None
    return (
        f"A demonstration of the stage: {tokens:,} tokens moved est. AL@5 by {100 * (now / was - 1):+.1f}% "
        f"({was:.3f} -> {now:.3f}), under the {100 * DEMONSTRATION_GAIN:.0f}% that would make it a better drafter; "
        "what the run serves is the released drafter's in effect. More train.max_minutes, more data "
        "(data.max_conversations) or params/smollm2-135m-cpu-scratch.yaml train for real."
    )


def result(summary: dict) -> dict:
    """For Stage.save: the summary of launch.launch, its final validation's headline figures (with
    train.init_from, the started-from drafter's too)."""
    ev = summary["eval"]
    headline = {
        "est. accept len @5": ev["est_accept_len"].get("5"),
        "cond_acc[0]": round(ev["cond_acc"][0], 3),
        "train tokens/s": summary["train_tokens_per_s"],
        "tokens": summary["tokens"],
    }
    kept = summary.get("kept") or {}
    if kept.get("rule", "last") != "last":
        headline["drafter kept"] = f"step {kept['step']} of {kept['last_step']} ({kept['rule']})"
    if (summary.get("vocab") or {}).get("warm_start") and summary.get("initial_eval"):
        headline["est. accept len @5 before"] = summary["initial_eval"]["est_accept_len"].get("5")
        if fine_tune_verdict(summary["initial_eval"], ev, summary["tokens"]):
            headline["fine-tune"] = "a demonstration (under +1% est. AL@5)"
    return {"figures": summary, "headline": headline, "artifacts": ARTIFACTS}


def online_plan_text(p, contract: dict) -> str:
    """Online mode's plan: where the capture and the trainers run, and the trainers' expected tokens/s from the
    rates last measured for this target under run.output_root: the capture's c (01_extract's capture rate, else
    its plain forward's) and training's t (02_train from shards). Sharing a device (the thread, or processes on one
    CPU) the two take turns: 1 / (1/c + 1/t); on devices of their own the slower one sets the pace: min(c, t)."""
    train = p.train
    split, shared = sources.online_placement(p).device_split(p)
    root = Path(p.run.output_root)
    fingerprint = contract["target_fingerprint"]
    capture = run_folder.last_measured(
        root, "01_extract", "tokens_per_s", {"backend": p.extract.backend, "target_fingerprint": fingerprint}
    ) or run_folder.last_measured(root, "01_extract", "forward_tokens_per_s", {"target_fingerprint": fingerprint})
    trained = run_folder.last_measured(
        root, "02_train", "train_tokens_per_s", {"target_fingerprint": fingerprint, "source": "shards"}
    )
    if capture and trained:
        c, t = capture["value"], trained["value"]
        expected = 1 / (1 / c + 1 / t) if shared else min(c, t)
        how = "taking turns, 1/(1/c + 1/t)" if shared else "side by side, min(c, t)"
        rate = (
            f"expected ~{expected:,.0f} trainer tokens/s ({how}; capture c = {c:,.0f} tokens/s by run "
            f"{capture['run']!r}, training t = {t:,.0f} by run {trained['run']!r})"
        )
    else:
        missing = [name for name, got in (("capture", capture), ("training from shards", trained)) if not got]
        rate = f"no expected rate yet: no {' or '.join(missing)} rate measured for this target under {root}"
    mode = "this run" if train.source == "online" else "with train.source: online"
    disk = (
        "the first epoch's states on disk (online_cache_first_epoch)"
        if train.online_cache_first_epoch
        else "0 bytes of states on disk"
    )
    return f"02_train online plan ({mode}, placement {train.online_placement}): {split}; {disk}; {rate}"
