"""Regeneration through a serving engine (regenerate.py's notes): the conversations in input order, a window of them
in flight, each advancing to its next turn as soon as its reply is back, the token budget's rule applied in input
order as they finish."""

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from tqdm.auto import tqdm

from eagle3lib.prepare.regenerate_turns import Job, next_prompt, record, start, take_reply


def regenerate_one(tokenizer, conv, max_prompt_tokens, reply, tokenizer_lock) -> dict:
    """engines: one conversation, turn after turn, as soon as each reply is back."""
    st = start(conv)
    while not st["stop"]:
        with tokenizer_lock:
            prompt = next_prompt(tokenizer, st, max_prompt_tokens)
        if prompt is not None:
            take_reply(st, *reply(prompt))
    return record(st)


class Dropped(Exception):
    """A conversation started ahead of its admission and then refused: its remaining turns are not asked."""


def in_window(job: Job, engine_turn: Callable, lock, window: int):
    """engines: conversations in input order, `window` of them in flight, each advancing to its next turn as
    soon as its reply is back (hf's waves wait for the batch's longest reply: SGLang on an H200 managed
    3,277 tokens/s that way). The budget's rule is of the replies alone, not of timing: conversation i is
    regenerated only while conversations 0 .. i - window spent less than the budget. A conversation starts as soon
    as a slot is free, ahead of that rule (waiting for conversation i - window to finish held slots idle behind a
    long conversation: a mean of 60 of 256 in flight, benchmarks/README.md); the rule is applied in input order
    as the conversations finish, and one refused (with all after it) is dropped unwritten, its remaining turns not
    asked. Records are written in input order. The replies themselves are the same in a rerun where the engine's
    kernels do not depend on batch shape (vLLM's CPU build in fp32; bf16 rounds by batch shape, docs/design.md
    §3). engine_turn: regenerate.engine_reply over the engine, whose tokenizer lock is `lock`. Returns
    (stopped_at, this_run)."""
    tokenizer, conversations, done = job.tokenizer, job.conversations, job.done
    drop_from = [len(conversations)]  # conversations from drop_from on are refused
    spent_before = [0]  # spent_before[i]: tokens of conversations 0 .. i-1 (done earlier or regenerated here)
    this_run, stopped_at, settled = 0, None, []
    replied = [0]  # tokens of every reply back so far (the conversations in flight included): the sizing's rate
    bar = tqdm(total=len(conversations), desc="regenerate", disable=not job.progress)
    t0 = time.perf_counter()

    def reply_of(index):  # conversation index's turns; one refused stops at its next turn
        def reply(prompt):
            if index >= drop_from[0]:
                raise Dropped
            text, n, finished = engine_turn(prompt)
            with lock:
                replied[0] += n
            return text, n, finished

        return reply

    def admitted(i) -> bool:  # the budget's rule for conversation i, once 0 .. i-1 are settled
        return spent_before[max(0, i - window + 1)] < job.budget.at(i)

    running, started = {}, 0  # conversations 0 .. started-1 are running, finished, or were done earlier
    pool = ThreadPoolExecutor(window)

    def fill():  # the free slots, in input order, while what is settled so far does not refuse the next one
        nonlocal started
        while started < len(conversations) and sum(not f.done() for f in running.values()) < window:
            known = spent_before[min(len(spent_before) - 1, max(0, started - window + 1))]  # the rule only grows
            if known >= job.budget.at(started):
                drop_from[0] = min(drop_from[0], started)
                return
            if conversations[started]["id"] not in done:
                conv, reply = conversations[started], reply_of(started)
                running[started] = pool.submit(regenerate_one, tokenizer, conv, job.max_prompt_tokens, reply, lock)
            started += 1

    try:
        for i, conv in enumerate(conversations):  # in input order: the rule, the records, the spent tokens
            fill()
            if not admitted(i):
                stopped_at = drop_from[0] = i
                break
            if conv["id"] in done:
                tokens = done[conv["id"]]["generated_tokens"]
            else:
                while not running[i].done():  # a slot freed by a later conversation is filled at once
                    wait([running[i], *(f for f in running.values() if not f.done())], return_when=FIRST_COMPLETED)
                    fill()
                record = running.pop(i).result()
                tokens = record["generated_tokens"]
                settled.append(tokens)
                if job.budget.pending and len(settled) == window:  # less one window of conversations in flight
                    # from the conversation a window after this one on (the rule's first one to read it)
                    job.budget.decide(i + window, replied[0], time.perf_counter() - t0, window, sum(settled))
                job.write([record], index=i)
                this_run += tokens
            spent_before.append(spent_before[-1] + tokens)
            bar.update()
    finally:
        drop_from[0] = 0  # whatever still runs (a failure ended the loop) stops at its next turn
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    return stopped_at, this_run
