"""The 00_prepare notebook's steps that are more than one call: which view of the target to load, the
regenerated replies put into the splits, the token files, and the stage's result."""

from __future__ import annotations

from pathlib import Path

from eagle3lib import target
from eagle3lib.params import cache_dir, load_params
from eagle3lib.prepare import conversations, regenerate, sources

ARTIFACTS = ["train.safetensors", "val.safetensors", "bench.jsonl", "eagle3.json"]
TOKENIZED = ("train", "val")  # the bench split stays prompts (bench.jsonl): the engines tokenize it themselves


def load_target(p):
    """(model, tokenizer). The weights only when this process generates the replies (data.regenerate with a
    budget and backend hf); else the config, generation config and tokenizer, all the stage reads (an engine
    loads the weights if it generates)."""
    rg = p.data.regenerate
    if rg.budget_tokens > 0 and rg.backend == "hf":
        return target.load_target(
            p.target.name,
            cache_dir(p),
            dtype=p.target.dtype,
            device=p.target.device,
            trust_remote_code=p.target.trust_remote_code,
        )
    return target.load_target_info(p.target.name, cache_dir(p), trust_remote_code=p.target.trust_remote_code)


def regenerate_plan_text(p, fingerprint: str) -> str:
    """What regeneration will cost: the token budget at the rate last measured on this target with this backend
    (any finished run under the same output_root)."""
    from eagle3lib import run_folder

    rg = p.data.regenerate
    if rg.budget_tokens <= 0:
        return "regeneration: none (data.regenerate.budget_tokens is 0): the data's own replies are trained on"
    backend = f"engine:{p.engine.name}" if rg.backend == "engine" else rg.backend
    rate = run_folder.last_measured(
        p.run.output_root,
        "00_prepare",
        "regenerate.tokens_per_s",
        {"regenerate.backend": backend, "target.fingerprint": fingerprint},
    )
    when = (
        f"about {rg.budget_tokens / rate['value'] / 60:,.1f} min at {rate['value']:,.1f} tokens/s (measured by run "
        f"{rate['run']!r})"
        if rate
        else "no rate measured yet for this target and backend (this run measures it)"
    )
    limit = (
        f"; at most {rg.max_minutes:g} min (data.regenerate.max_minutes): the budget is cut to what the first "
        f"{rg.batch_size} conversations' rate fits"
        if rg.max_minutes
        else ""
    )
    return f"regeneration plan ({backend}): up to {rg.budget_tokens:,} tokens, {when}{limit}"


def load_pool(p) -> tuple[list[dict], dict]:
    """The run's conversations (data.sources, data.max_conversations), less the val and bench conversations of each
    params file in data.keep_unseen (read and split as that run does), so that what those runs evaluate on stays
    unseen here; read stats with {"kept_unseen": {file: conversations left out}}."""
    loaded, stats = sources.load_conversations(p.data.sources, limit=p.data.max_conversations)
    stats["kept_unseen"] = {}
    for other_file in p.data.keep_unseen:
        other = load_params(other_file)
        theirs, _ = sources.load_conversations(other.data.sources, limit=other.data.max_conversations)
        split = conversations.split_conversations(
            theirs, other.data.val_fraction, other.data.bench_count, other.run.seed
        )
        loaded, left_out = conversations.without_held_out(loaded, split["val"] + split["bench"])
        stats["kept_unseen"][other_file] = left_out
    return loaded, stats


def split_sizes(splits: dict) -> dict:
    return {name: len(convs) for name, convs in splits.items()}


def regenerate_splits(p, model, tokenizer, splits: dict, out: Path) -> tuple[dict, dict]:
    """The target answers train's and val's conversations itself (data.regenerate; none without a budget),
    appending to out/regenerated.jsonl, which a rerun resumes. Returns (the splits with the regenerated
    conversations in place, and only those when only_regenerated, the regeneration's stats)."""
    rg = p.data.regenerate
    if rg.budget_tokens <= 0:
        return splits, {"tokens_generated": 0}
    path = Path(out) / "regenerated.jsonl"
    # Interleaved, so a budget that runs out leaves train and val their shares of the target's own replies.
    # Backend "engine": the run's serving engine generates (no drafter), its log lands next to the file.
    stats = regenerate.regenerate(
        rg,
        model,
        tokenizer,
        conversations.interleave(splits["train"], splits["val"]),
        path,
        engine_params=p.engine,
        target_dir=target.resolve_target(p.target.name, cache_dir(p)),
        dtype=p.target.dtype,
    )
    if stats.get("sizing"):  # data.regenerate.max_minutes: what the budget was cut to, and why
        print(stats["sizing"]["text"])
    regenerated = regenerate.read_regenerated(path)
    kept = {
        name: [regenerated.get(c["id"], c) for c in splits[name] if c["id"] in regenerated or not rg.only_regenerated]
        for name in TOKENIZED
    }
    return splits | kept, stats


def write_tokens(tokenizer, splits: dict, max_seq_len: int, out: Path) -> dict:
    """train and val through the chat template into out/<split>.safetensors (ids and loss mask), the bench
    split's prompts into out/bench.jsonl. Returns {split: {sequences, tokens, loss_tokens}}."""
    out = Path(out)
    stats = {}
    for name in TOKENIZED:
        tokens = conversations.tokenize_split(tokenizer, splits[name], max_seq_len)
        conversations.save_tokens(out / f"{name}.safetensors", tokens)
        stats[name] = {
            "sequences": len(tokens["seq_starts"]) - 1,
            "tokens": int(len(tokens["input_ids"])),
            "loss_tokens": int(tokens["loss_mask"].sum()),
        }
    conversations.save_bench_prompts(out / "bench.jsonl", splits["bench"])
    return stats


def result(
    read_stats: dict,
    splits: dict,
    regen_stats: dict,
    token_stats: dict,
    contract: dict,
    target_dir: str,
    seconds: float,
) -> dict:
    """The stage's result for Stage.save: figures, the index's headline, the artifacts that must exist."""
    figures = {
        "read": read_stats,
        "splits": split_sizes(splits),
        "regenerate": regen_stats,
        "tokens": token_stats,
        "target": {
            "layers": contract["num_layers"],
            "aux_layer_ids": contract["aux_layer_ids"],
            "fingerprint": contract["target_fingerprint"],
            "path": str(target_dir),
        },
        "seconds": seconds,
    }
    headline = {
        "conversations": sum(len(v) for v in splits.values()),
        "train tokens": token_stats["train"]["tokens"],
        "regenerated tokens": regen_stats.get("tokens_generated", 0),
    }
    if sizing := regen_stats.get("sizing"):
        headline["regeneration (max_minutes)"] = sizing["text"]
    return {"figures": figures, "headline": headline, "artifacts": ARTIFACTS}
