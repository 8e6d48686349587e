"""Conversations (sources.py reads them) -> train / val / bench splits -> chat template -> token ids + loss
mask; the bench prompts. The target's regenerated replies: regenerate.py.

A conversation is `{"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}]}`.
The loss mask is 1 exactly on the tokens of assistant turns: the reply and its end-of-turn
token (e.g. SmolLM2's `<|im_end|>`), never the role header nor system/user text.
"""

import hashlib
import json
import os
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

# ---------------------------------------------------------------------------------------
# Splitting


def _unit(seed, salt: str, cid: str) -> float:
    h = hashlib.sha256(f"{seed}\0{salt}\0{cid}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def split_conversations(conversations, val_fraction: float, bench_count: int, seed) -> dict[str, list]:
    """Split into train / val / bench by a hash of (seed, id), whatever the input order.

    Duplicate ids are kept once. Bench takes the `bench_count` conversations with the smallest
    hash among those whose first user turn (the bench prompt) is unique in the input, so
    generic prompts like "continue" or "hi" are never bench prompts; train and val then drop
    any conversation that has a bench prompt as one of its user turns. Of the rest, a
    conversation goes to val when its hash says so (probability `val_fraction`). Lists come
    in hash order.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"Expected val_fraction in [0, 1), found {val_fraction!r}.")
    if bench_count < 0:
        raise ValueError(f"Expected bench_count >= 0, found {bench_count!r}.")
    unique = {}
    for c in sorted(conversations, key=lambda c: (c["id"], json.dumps(c["messages"], sort_keys=True))):
        unique.setdefault(c["id"], c)
    ordered = sorted(unique.values(), key=lambda c: (_unit(seed, "order", c["id"]), c["id"]))

    def user_texts(c):
        return [m["content"].strip() for m in c["messages"] if m["role"] == "user"]

    first_prompts = Counter(user_texts(c)[0] for c in ordered)
    bench = [c for c in ordered if first_prompts[user_texts(c)[0]] == 1][:bench_count]
    bench_ids = {c["id"] for c in bench}
    bench_prompts = {user_texts(c)[0] for c in bench}
    rest = [c for c in ordered if c["id"] not in bench_ids and not bench_prompts.intersection(user_texts(c))]
    val = [c for c in rest if _unit(seed, "val", c["id"]) < val_fraction]
    train = [c for c in rest if _unit(seed, "val", c["id"]) >= val_fraction]
    return {"train": train, "val": val, "bench": bench}


# ---------------------------------------------------------------------------------------
# Chat template -> token ids + loss mask


def render(tokenizer, messages, add_generation_prompt=False) -> str:
    """The conversation as the chat template writes it (text, not ids)."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)


def assistant_spans(tokenizer, messages) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant turn in it.

    A turn's span is what rendering it adds after the generation prompt, cut just after the
    last end-of-turn (eos) token inside it, so the template's trailing newline is left out.
    """
    text = render(tokenizer, messages)
    eos = tokenizer.eos_token
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        through = render(tokenizer, messages[: i + 1])
        if not through.startswith(before) or not text.startswith(through):
            raise ValueError(
                f"Expected the chat template to render conversations prefix-stably (the rendering up to "
                f"assistant turn {i} with the generation prompt should start the full rendering), found it "
                f"does not: {before[-80:]!r} vs {through[len(before) - 80 : len(before) + 20]!r}. This template "
                "rewrites earlier turns (e.g. drops reasoning); use a template that does not, or mask another way."
            )
        start, end = len(before), len(through)
        if eos:
            k = through.rfind(eos, start, end)
            if k >= 0:
                end = k + len(eos)
        spans.append((start, end))
    return text, spans


def tokenize_conversation(tokenizer, messages, max_seq_len: int) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one conversation through the tokenizer's chat template."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"Expected a fast tokenizer (offset mappings are needed for the loss mask), "
            f"found {type(tokenizer).__name__}. Load it with use_fast=True."
        )
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, mask, span_i = enc["input_ids"], [], 0
    for s, e in enc["offset_mapping"]:
        while span_i < len(spans) and spans[span_i][1] <= s:
            span_i += 1
        inside = span_i < len(spans) and e > s and s < spans[span_i][1] and e > spans[span_i][0]
        mask.append(int(inside))
    return list(ids[:max_seq_len]), mask[:max_seq_len]


def tokenize_split(tokenizer, conversations, max_seq_len: int, progress: bool = True) -> dict:
    """Tokenize conversations into flat arrays: input_ids int32 [N], loss_mask uint8 [N],
    seq_starts int64 [S+1], ids (list of str), plus counts. Sequences left with no loss
    tokens after truncation are skipped and counted."""
    all_ids, all_mask, starts, kept_ids, no_loss = [], [], [0], [], 0
    for conv in tqdm(conversations, desc="tokenize", disable=not progress):
        ids, mask = tokenize_conversation(tokenizer, conv["messages"], max_seq_len)
        if not any(mask):
            no_loss += 1
            continue
        all_ids.extend(ids)
        all_mask.extend(mask)
        starts.append(len(all_ids))
        kept_ids.append(conv["id"])
    loss_mask = torch.tensor(all_mask, dtype=torch.uint8)
    return {
        "input_ids": torch.tensor(all_ids, dtype=torch.int32),
        "loss_mask": loss_mask,
        "seq_starts": torch.tensor(starts, dtype=torch.int64),
        "ids": kept_ids,
        "stats": {
            "sequences": len(kept_ids),
            "tokens": len(all_ids),
            "loss_tokens": int(loss_mask.sum()),
            "skipped_no_loss_tokens": no_loss,
            "max_seq_len": max_seq_len,
        },
    }


def save_tokens(path, tokens: dict) -> Path:
    """Write a tokenize_split result as safetensors (ids and stats in the metadata), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: tokens[k].contiguous() for k in ("input_ids", "loss_mask", "seq_starts")}
    meta = {"ids": json.dumps(tokens["ids"]), "stats": json.dumps(tokens.get("stats", {}))}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return path


def load_tokens(path) -> dict:
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Expected a token file {path}, found none; rerun the prepare stage.")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    tokens = load_file(str(path))
    tokens["ids"] = json.loads(meta.get("ids", "[]"))
    tokens["stats"] = json.loads(meta.get("stats", "{}"))
    return tokens


# ---------------------------------------------------------------------------------------
# Bench prompts: one JSON line per bench conversation, up to its first assistant turn


def save_bench_prompts(path, conversations) -> Path:
    """Write `{"id", "messages" (system/user turns before the first reply), "reference" (that
    reply)}` per conversation as JSONL, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for c in conversations:
        k = next(j for j, m in enumerate(c["messages"]) if m["role"] == "assistant")
        lines.append(
            json.dumps({"id": c["id"], "messages": c["messages"][:k], "reference": c["messages"][k]["content"]}) + "\n"
        )
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(lines), encoding="utf-8")
    os.replace(tmp, path)
    return path


def load_bench_prompts(path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Expected bench prompts {path}, found none; rerun the prepare stage.")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def interleave(*lists: list) -> list:
    """Items of several lists merged so each keeps its share at every prefix (order kept within each)."""
    total = sum(len(x) for x in lists)
    keyed = [((i + 0.5) / len(x), j, item) for j, x in enumerate(lists) for i, item in enumerate(x)]
    return [item for _, _, item in sorted(keyed, key=lambda k: (k[0], k[1]))][:total]
