"""The 01_extract notebook's steps that are more than one call: the tokens' check against the target, every
split through one capture, the overhead against a plain prefill, the read-back and the stage's result."""

from __future__ import annotations

from pathlib import Path

from eagle3lib import run_folder, target
from eagle3lib.extract import backends, shards, sizing
from eagle3lib.prepare import conversations


def check_tokens_match(contract: dict, prep_dir: Path) -> None:
    """The tokens were made with this target's tokenizer and chat template (00_prepare's eagle3.json);
    refuse anything else."""
    prep_dir = Path(prep_dir)
    target.check_contract(
        {k: contract[k] for k in ("target_fingerprint", "chat_template_hash", "vocab_size")},
        target.read_contract(prep_dir),
        str(prep_dir / target.CONTRACT_FILE),
    )


def extract_splits(p, setup: dict, capture: backends.Backend, prep_dir: Path, out: Path) -> dict:
    """extract.splits' tokens (prep_dir/<split>.safetensors) through `capture` (make_capture's, which holds what it
    needs of `setup`) into out/<split>/ shards, one after the other, the target loaded once; {split: result}.
    With extract.max_minutes the validation split goes first and the training split is cut to what fits the rest,
    with extract.max_train_tokens to its first sequences within that many tokens (sizing.py), which prints what it
    was cut to and why (sizing_record reads it back for the result)."""
    splits = {s: (Path(prep_dir) / f"{s}.safetensors", Path(out) / s) for s in p.extract.splits}
    budget = extract_budget(p, out)
    if budget is None:
        return capture.extract_splits(splits)
    results = capture.extract_splits(splits, budget)
    if budget.decision:
        print(budget.decision["text"])
    return results


def extract_budget(p, out: Path) -> sizing.ExtractBudget | None:
    """The cut extract.max_minutes and extract.max_train_tokens ask for, None without either."""
    if p.extract.max_minutes is None and p.extract.max_train_tokens is None:
        return None
    return sizing.ExtractBudget(Path(out), p.extract.max_minutes, p.extract.max_train_tokens)


def sizing_record(p, out: Path) -> dict | None:
    """What extract.max_minutes or extract.max_train_tokens cut the training split to (sizing.json), None without
    either."""
    budget = extract_budget(p, out)
    return budget.recorded() if budget else None


def capture_over_plain_prefill(p, setup: dict, capture: backends.Backend, prep_dir: Path, results: dict, log_dir=None):
    """(plain prefill tokens/s, extraction / plain prefill) on the train split's first batches: hf, the target's
    plain forward; vllm / sglang, the same engine's plain prefill. Both go into results["train"] too."""
    tokens = conversations.load_tokens(Path(prep_dir) / "train.safetensors")
    train = results.get("train", {})
    plain = capture.plain_prefill_tokens_per_s(tokens, train, log_dir=log_dir)
    ratio = train.get("tokens_per_s") / plain if plain and train.get("tokens_per_s") else None
    train.update(plain_prefill_tokens_per_s=plain, capture_over_plain_prefill=ratio)
    return plain, ratio


def verify(out: Path, results: dict) -> None:
    """Read every split's shards back once (checksums and shapes); each must hold all its sequences."""
    for split, r in results.items():
        found = shards.ShardSet(Path(out) / split).verify_all()
        if found != r["total_sequences"]:
            raise shards.ShardError(f"{split}: {found} sequences read back, expected {r['total_sequences']}")


def plan_text(p, contract: dict, tokens: int, free_bytes: int | None = None) -> str:
    """What 01_extract will write for `tokens` tokens: bytes on disk in the store dtype (4 states of H values a
    token, and fp8's scales), against the free space, and the time at the capture rate last measured on this target with this
    backend (any finished run under the same output_root)."""
    import shutil

    import torch

    dtype = getattr(torch, p.extract.store_dtype)
    per = shards.bytes_per_token(contract["hidden_size"], dtype, len(contract["aux_layer_ids"]))
    need = tokens * per
    root = Path(p.run.output_root)
    free = shutil.disk_usage(root if root.exists() else Path.cwd()).free if free_bytes is None else free_bytes
    rate = run_folder.last_measured(
        root,
        "01_extract",
        "tokens_per_s",
        {"backend": p.extract.backend, "target_fingerprint": contract["target_fingerprint"]},
    )
    when = (
        f"at {rate['value']:,.0f} tokens/s (measured by run {rate['run']!r}) about {tokens / rate['value'] / 60:,.1f} min"
        if rate
        else "no capture rate measured yet for this target and backend (the first run measures it)"
    )
    states = len(contract["aux_layer_ids"]) + 1
    scales = f" + {states} float32 scales" if dtype == shards.FP8 else ""
    text = (
        f"01_extract plan ({p.extract.backend}): {tokens:,} tokens x {per:,} bytes ({states} states of "
        f"{contract['hidden_size']} in {p.extract.store_dtype}{scales}) = {need / 1e9:,.3f} GB on disk, "
        f"{free / 1e9:,.1f} GB free; {when}"
    )
    if p.extract.max_minutes:
        text += (
            f"; at most {p.extract.max_minutes:g} min (extract.max_minutes): the val split first, then the train "
            "split's leading sequences that fit the rest at val's rate"
        )
    if p.extract.max_train_tokens:
        text += f"; the train split's leading sequences within {p.extract.max_train_tokens:,} tokens (extract.max_train_tokens)"
    if need > free:
        text += f"\nNOT ENOUGH DISK: {need - free:,} bytes short; free space or set run.output_root elsewhere"
    return text


def result(
    results: dict,
    plain_tokens_per_s,
    ratio,
    aux_ids: list[int],
    store_dtype: str,
    backend=None,
    fingerprint=None,
    sized: dict | None = None,
) -> dict:
    """The stage's result for Stage.save: figures, the index's headline, the artifacts that must exist. sized:
    sizing_record's cut of the training split, if any."""
    train = results.get("train", {})
    total = {
        "sequences": sum(r["total_sequences"] for r in results.values()),
        "tokens": sum(r["total_tokens"] for r in results.values()),
        "bytes": sum(r["bytes"] for r in results.values()),
    }
    figures = {
        "splits": results,
        "forward_tokens_per_s": plain_tokens_per_s,
        "capture_over_forward": ratio,
        "aux_layer_ids": aux_ids,
        "store_dtype": store_dtype,
        **total,
        "bytes_per_token": train.get("bytes_per_token"),
        "tokens_per_s": train.get("tokens_per_s"),
        "backend": backend,  # with the fingerprint, what a later run's plan looks its rate up by
        "target_fingerprint": fingerprint,
        "sizing": sized,
    }
    headline = {
        "tokens": total["tokens"],
        "tokens/s": train.get("tokens_per_s"),
        "vs forward": None if ratio is None else round(ratio, 2),
        "MB": round(total["bytes"] / 1e6, 1),
    }
    if sized and sized["sequences"] < sized["total_sequences"]:
        headline["train split (cut)"] = f"{sized['sequences']:,} of {sized['total_sequences']:,} sequences"
    return {"figures": figures, "headline": headline, "artifacts": [f"{s}/manifest.json" for s in results]}
