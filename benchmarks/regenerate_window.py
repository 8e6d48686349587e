"""How many conversations the engine regeneration keeps in flight, replayed on the embedded ShareGPT's turns
(no engine): starts in input order once the conversation a window before has finished (the rule until
2026-12-05), against starts on any free slot (data.regenerate's engine mode now).

    python benchmarks/regenerate_window.py --conversations 1500 --window 256 --max-new-tokens 256  # tiny-h200.yaml
    python benchmarks/regenerate_window.py --conversations 320 --window 32 --max-new-tokens 64     # tiny.yaml

A model, not a measurement: each turn takes its reply's tokens times one decode step, the step's time the same at
any batch size (a small target on a GPU is near that; a 2-core CPU is not). Replies: the original ones' token
counts, capped at --max-new-tokens, a conversation cut after a capped reply as the regeneration cuts it. Prints
each rule's steps to finish and its mean conversations in flight.
"""

from __future__ import annotations

import argparse
import heapq

from eagle3lib import target
from eagle3lib.params import cache_dir, load_params
from eagle3lib.prepare import sources


def reply_lengths(conversations, tokenizer, max_new_tokens: int) -> list[list[int]]:
    out = []
    for conv in conversations:
        turns = []
        for m in conv["messages"]:
            if m["role"] == "assistant":
                n = len(tokenizer(m["content"], add_special_tokens=False)["input_ids"])
                turns.append(max(1, min(n, max_new_tokens)))
                if n >= max_new_tokens:
                    break
        if turns:
            out.append(turns)
    return out


def in_order_steps(convs: list[list[int]], window: int) -> float:
    """Conversation i starts once i - window has finished, and finishes are taken in input order."""
    finish, settled = [0.0] * len(convs), 0.0
    for i, turns in enumerate(convs):
        start = 0.0
        if i >= window:
            settled = max(settled, finish[i - window])
            start = settled
        finish[i] = start + sum(turns)
    return max(finish)


def free_slot_steps(convs: list[list[int]], window: int) -> float:
    """Conversation i starts on the first slot free."""
    slots = [0.0] * window
    for turns in convs:
        heapq.heappush(slots, heapq.heappop(slots) + sum(turns))
    return max(slots)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="params/tiny.yaml")
    ap.add_argument("--conversations", type=int, default=1500)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    args = ap.parse_args()
    p = load_params(args.params)
    conversations, _ = sources.load_conversations(p.data.sources, limit=args.conversations)
    _, tokenizer = target.load_target_info(p.target.name, cache_dir(p))
    convs = reply_lengths(conversations, tokenizer, args.max_new_tokens)
    tokens = sum(map(sum, convs))
    print(f"{len(convs)} conversations, {tokens:,} reply tokens, window {args.window}")
    for name, steps in (
        ("in order", in_order_steps(convs, args.window)),
        ("free slot", free_slot_steps(convs, args.window)),
    ):
        print(f"{name:>9}: {steps:,.0f} steps, {tokens / steps:.0f} conversations in flight on average")


if __name__ == "__main__":
    main()
