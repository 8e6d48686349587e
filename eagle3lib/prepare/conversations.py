"""Conversations (sources.py reads them) -> train / val / bench splits -> chat template -> token ids + loss
mask; the bench prompts. The target's regenerated replies: regenerate.py.

A conversation is `{"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}]}`.
The loss mask is 1 exactly on what the model writes in assistant turns: what follows the chat template's
generation prompt, through the end-of-turn token (e.g. SmolLM2's `<|im_end|>`; Kimi's `</think>`, the reply and
`<|im_end|>`), never the role header nor system/user/tool text.
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


def user_texts(c) -> list[str]:
    return [m["content"].strip() for m in c["messages"] if m["role"] == "user"]


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

    first_prompts = Counter(user_texts(c)[0] for c in ordered)
    bench = [c for c in ordered if first_prompts[user_texts(c)[0]] == 1][:bench_count]
    bench_ids = {c["id"] for c in bench}
    bench_prompts = {user_texts(c)[0] for c in bench}
    rest = [c for c in ordered if c["id"] not in bench_ids and not bench_prompts.intersection(user_texts(c))]
    val = [c for c in rest if _unit(seed, "val", c["id"]) < val_fraction]
    train = [c for c in rest if _unit(seed, "val", c["id"]) >= val_fraction]
    return {"train": train, "val": val, "bench": bench}


def without_held_out(conversations, held_out) -> tuple[list, int]:
    """(conversations less those of `held_out` (another run's val and bench), by id or by a shared user turn (the
    same prompt under another id), the number left out)."""
    ids = {c["id"] for c in held_out}
    prompts = {t for c in held_out for t in user_texts(c)}
    kept = [c for c in conversations if c["id"] not in ids and not prompts.intersection(user_texts(c))]
    return kept, len(conversations) - len(kept)


# ---------------------------------------------------------------------------------------
# Chat template -> token ids + loss mask


def render(tokenizer, messages, add_generation_prompt=False) -> str:
    """The conversation as the chat template writes it (text, not ids)."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)


REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


def turn_pieces(tokenizer, messages) -> tuple[list[list[tuple[str, bool]]], int]:
    """The conversation rendered turn by turn: (sequences, reasoning_dropped). A sequence is a list of
    (text, generated) pieces; `generated` marks what the model writes in an assistant turn.

    For assistant turn i the context is the template's rendering of the messages before it with the generation
    prompt, exactly what the engine is given; the generated part is what the template writes after that prompt
    when turn i is the last message, cut after its last end-of-turn token (eos, else trailing whitespace is
    left out). Where a turn's context continues the sequence so far, it extends it; where the template rewrites
    earlier turns (Kimi's strips reasoning from the history, others mark the last message), the turn starts a new
    sequence with its own context, so that no turn is trained on a context the model never sees.
    reasoning_dropped counts turns whose reasoning field the template does not render."""
    sequences, pieces, so_far, dropped = [], [], None, 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        context = render(tokenizer, messages[:i], add_generation_prompt=True)
        before = render(tokenizer, messages[:i]) if i else ""
        prompt = context[len(before) :] if context.startswith(before) else ""
        through = render(tokenizer, messages[: i + 1])
        at = through.rfind(prompt) if prompt else -1
        content = message.get("content")
        written = through[at + len(prompt) :] if at >= 0 else ""
        if at < 0 or (isinstance(content, str) and content.strip() not in written):
            raise ValueError(
                f"Expected the chat template to write assistant turn {i} after its generation prompt "
                f"({prompt[-60:]!r}), found {'no generation prompt' if not prompt else 'it elsewhere'} in "
                f"{through[-200:]!r}. The loss mask needs a template whose generation prompt starts each assistant turn."
            )
        eos = tokenizer.eos_token
        cut = written.rfind(eos) + len(eos) if eos and eos in written else len(written.rstrip())
        generated, tail = written[:cut], written[cut:]
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k)), None)
        dropped += bool(reasoning) and reasoning not in generated
        if so_far is not None and context.startswith(so_far):
            pieces.append((context[len(so_far) :], False))
        else:
            if pieces:
                sequences.append(pieces)
            pieces = [(context, False)]
        pieces += [(generated, True), (tail, False)]
        so_far = context + generated + tail
    if pieces:
        sequences.append(pieces)
    return sequences, dropped


def end_of_turn_ids(tokenizer) -> set[int]:
    """The id the chat template ends an assistant turn with (SmolLM2's and Kimi's `<|im_end|>`, Llama 3's
    `<|eot_id|>`), where that is one token; a model stops there even when its config's eos is another id
    (Kimi-K2.5's config says [EOS])."""
    reply = "Hello"
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}]
    written = next(text for text, generated in turn_pieces(tokenizer, probe)[0][0] if generated)
    after = written[written.rfind(reply) + len(reply) :].strip()
    ids = _ids(tokenizer, after) if after else []
    return set(ids) if len(ids) == 1 else set()


def tokenize_conversation(tokenizer, messages, max_seq_len: int) -> list[tuple[list[int], list[int]]]:
    """[(input_ids, loss_mask)] of one conversation, one pair per sequence of turn_pieces, each piece tokenized
    on its own (as the engine tokenizes the prompt and then appends what the model writes), so no tokenizer
    offsets are needed; each sequence cut to max_seq_len."""
    return _tokenize(tokenizer, messages, max_seq_len)[0]


def _tokenize(tokenizer, messages, max_seq_len: int) -> tuple[list, int]:
    out = []
    sequences, dropped = turn_pieces(tokenizer, messages)
    for pieces in sequences:
        ids, mask = [], []
        for text, generated in pieces:
            piece = _ids(tokenizer, text) if text else []
            ids += piece
            mask += [int(generated)] * len(piece)
        out.append((ids[:max_seq_len], mask[:max_seq_len]))
    return out, dropped


def _ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids]


def tokenize_split(tokenizer, conversations, max_seq_len: int, progress: bool = True) -> dict:
    """Tokenize conversations into flat arrays: input_ids int32 [N], loss_mask uint8 [N],
    seq_starts int64 [S+1], ids (list of str; a conversation's second and later sequences, where the template
    rewrites its history, as "id#k"), plus counts. Sequences left with no loss tokens after truncation are
    skipped and counted."""
    all_ids, all_mask, starts, kept_ids, no_loss, dropped = [], [], [0], [], 0, 0
    for conv in tqdm(conversations, desc="tokenize", disable=not progress):
        sequences, n = _tokenize(tokenizer, conv["messages"], max_seq_len)
        dropped += n
        for k, (ids, mask) in enumerate(sequences):
            if not any(mask):
                no_loss += 1
                continue
            all_ids.extend(ids)
            all_mask.extend(mask)
            starts.append(len(all_ids))
            kept_ids.append(conv["id"] if k == 0 else f"{conv['id']}#{k}")
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
            "reasoning_dropped_turns": dropped,  # turns whose reasoning the chat template does not render
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
