"""Regenerating responses with the target (greedy), resumably.

Turn by turn: each assistant turn is replaced by the target's greedy reply to the
conversation so far (with its own earlier replies). A conversation is cut after its last
regenerated turn when a reply hits max_new_tokens (the target had not finished, so later
user turns no longer fit), or when the next prompt exceeds max_prompt_tokens.
The token budget: hf runs fixed batches and checks it before each wave of a batch's turns;
engines run the conversations in order, batch_size in flight, and check it before starting
a conversation (see regenerate_window.py). Conversations not started keep their original responses.

The time limit (data.regenerate.max_minutes): after the first batch (hf) or window of conversations (engines) the
token budget is cut to what the measured tokens/s fits in the minutes, less the conversations still in flight when
it runs out (see sizing.TokenBudget). The cut is decided once and recorded in every later line, so a resume keeps it and the
replies stay a rule of the budget, not of timing.

Resumable: each finished conversation (engines) or batch (hf) appends one JSON line per
conversation to out_path (flush + fsync). On restart, lines already there are kept, a torn
tail is cut off, and a partly written hf batch is recomputed whole (same batch, so the same
greedy outputs) with only its missing lines appended.
"""

import json
import os
import threading
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm.auto import tqdm

from eagle3lib.prepare import conversations
from eagle3lib.prepare.regenerate_turns import Job, next_prompt, record, start, take_reply
from eagle3lib.prepare.regenerate_window import in_window
from eagle3lib.prepare.sizing import TokenBudget


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
    """The ids that end a reply: the generation config's eos ids, the tokenizer's and the chat template's end of
    an assistant turn."""
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else []) | {tokenizer.eos_token_id}
    ids |= conversations.end_of_turn_ids(tokenizer)
    ids.discard(None)
    return ids


def _regenerate_batch(model, tokenizer, batch, max_new_tokens, max_prompt_tokens, budget_left, eos_ids, generate):
    """hf: the batch's conversations advance in waves, one padded generate call per wave."""
    states = [start(c) for c in batch]
    spent = 0
    while True:
        active, prompts = [], []
        for st in states:
            if not st["stop"]:
                prompt = next_prompt(tokenizer, st, max_prompt_tokens, over_budget=spent >= budget_left)
                if prompt is not None:
                    active.append(st)
                    prompts.append(prompt)
        if not active:
            break
        for st, reply in zip(active, generate(model, tokenizer, prompts, max_new_tokens, eos_ids)):
            spent += take_reply(st, *reply)
    return [record(st) for st in states]


def _in_batches(job: Job, model, batch_size: int, generate):
    """hf: fixed slices of batch_size conversations, one after the other. Returns (stopped_at, this_run)."""
    conversations, done = job.conversations, job.done
    used, this_run, stopped_at = 0, 0, None
    batches = [conversations[i : i + batch_size] for i in range(0, len(conversations), batch_size)]
    t0 = time.perf_counter()
    for b, batch in enumerate(tqdm(batches, desc="regenerate", disable=not job.progress)):
        if all(c["id"] in done for c in batch):
            used += sum(done[c["id"]]["generated_tokens"] for c in batch)
            continue
        if used >= job.budget.at(b):
            stopped_at = b
            break
        records = _regenerate_batch(
            model,
            job.tokenizer,
            batch,
            job.max_new_tokens,
            job.max_prompt_tokens,
            job.budget.at(b) - used,
            job.eos_ids,
            generate,
        )
        used += sum(r["generated_tokens"] for r in records)
        new = [r for r in records if r["id"] not in done]  # a partly written batch is recomputed whole
        this_run += sum(r["generated_tokens"] for r in new)
        if job.budget.pending:  # this run's first batch: the budget its rate fits, less one batch in flight
            batch_tokens = sum(r["generated_tokens"] for r in records)
            job.budget.decide(b + 1, batch_tokens, time.perf_counter() - t0, len(batch), batch_tokens)
        job.write(new, batch=b)
    return stopped_at, this_run


def done_with_settings(out_path: Path, settings: dict) -> dict:
    """The records already in out_path (its folder made), each written with these settings; ValueError otherwise."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = _read_done(out_path)
    for rec in done.values():
        if rec.get("settings") != settings:
            raise ValueError(
                f"{out_path} was written with settings {rec.get('settings')}, now {settings}. "
                "Delete it (or use another path) to regenerate with the new settings."
            )
    return done


def run_stats(recs: list[dict], conversations: int, this_run: int, seconds: float) -> dict:
    """regenerate_responses' counts over the records of its `conversations`, and this run's rate."""
    regenerated = sum(r["regenerated"] for r in recs)
    return {
        "conversations": conversations,
        "regenerated": regenerated,
        "kept_original": conversations - regenerated,
        "turns_regenerated": sum(r["turns_regenerated"] for r in recs),
        "tokens_generated": sum(r["generated_tokens"] for r in recs),
        "tokens_generated_this_run": this_run,
        "seconds_this_run": round(seconds, 2),
        "tokens_per_s": round(this_run / seconds, 1) if seconds > 0 and this_run else 0.0,
        "stops": dict(Counter(r["stop"] for r in recs)),
    }


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
    max_minutes: float | None = None,
) -> dict:
    """Replace assistant turns by the target's greedy replies, resumably, into out_path (JSONL).

    See the module's notes for what is cut and when. Returns stats; read the result back with
    `read_regenerated` or `apply_regenerated`. hf (engine None): batches of batch_size through
    `generate` (model.generate here by default); engine: a running engine server with batch_size
    conversations in flight; backend names it in the settings. max_minutes cuts the budget to what fits that
    long here (sizing.TokenBudget).
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
        # hf files written before backends existed, and files written before the time limit, stay resumable
        **({"backend": backend} if backend != "hf" else {}),
        **({"max_minutes": max_minutes} if max_minutes is not None else {}),
    }
    done = done_with_settings(out_path, settings)
    budget = TokenBudget.from_records(budget_tokens, max_minutes, done.values())
    eos_ids = eos_token_ids(model, tokenizer)
    saved = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    t0 = time.perf_counter()
    try:
        with open(out_path, "a", encoding="utf-8") as f:

            def write(records, **where):
                lines = (json.dumps({**r, **where, "settings": settings, **budget.record()}) + "\n" for r in records)
                f.write("".join(lines))
                f.flush()
                os.fsync(f.fileno())
                done.update({r["id"]: r for r in records})

            job = Job(
                tokenizer, conversations, done, write, budget, max_new_tokens, max_prompt_tokens, eos_ids, progress
            )
            if engine is None:
                stopped_at, this_run = _in_batches(job, model, batch_size, generate)
            else:
                lock = threading.Lock()
                engine_turn = engine_reply(engine, tokenizer, max_new_tokens, eos_ids, lock)
                stopped_at, this_run = in_window(job, engine_turn, lock, batch_size)
    finally:
        tokenizer.padding_side, tokenizer.pad_token = saved
    seconds = time.perf_counter() - t0
    recs = [done[i] for i in ids if i in done]
    return {
        **run_stats(recs, len(conversations), this_run, seconds),
        "backend": backend,
        "budget_tokens": budget_tokens,
        "budget_exhausted": stopped_at is not None,
        "sizing": budget.as_dict(),
        "note": "conversations after the budget ran out, and those with no regenerated turn, keep their original responses",
    }


def regenerate(
    rg,
    model,
    tokenizer,
    conversations,
    out_path: Path,
    engine_params=None,
    target_dir=None,
    progress: bool = True,
    dtype: str | None = None,
) -> dict:
    """regenerate_responses as params' data.regenerate section (rg) asks: backend "hf" generates
    with `model` here; "engine" starts the run's serving engine (engine_params with its quick_start_args, no drafter,
    in `dtype`, the target's: None = the engine's default) on target_dir, logs it next to out_path, and stops it when done
    (also on errors)."""
    kwargs = dict(
        budget_tokens=rg.budget_tokens,
        max_new_tokens=rg.max_new_tokens,
        batch_size=rg.batch_size,
        progress=progress,
        max_prompt_tokens=rg.max_prompt_tokens,
        max_minutes=rg.max_minutes,
    )
    if rg.backend == "hf":
        return regenerate_responses(model, tokenizer, conversations, out_path, **kwargs)
    from eagle3lib import engines

    # its speed is not measured: engine.quick_start_args (vLLM CPU: eager, a start of ~45 s instead of ~110-240)
    server = engines.make(engine_params.for_quick_start(), target_dir, None, None, Path(out_path).parent, dtype)
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
