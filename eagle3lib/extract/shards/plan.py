"""The plan of an extraction: shard boundaries and batches, a pure function of the sequence lengths and the budgets,
so that a run killed at any point and restarted computes exactly the batches the uninterrupted run would have."""

from __future__ import annotations


def plan_shards(lengths, first, end, shard_max_tokens):
    """Split sequences [first, end) into (first, end) ranges, closing a shard at shard_max_tokens."""
    ranges, start, acc = [], first, 0
    for s in range(first, end):
        acc += int(lengths[s])
        if acc >= shard_max_tokens:
            ranges.append((start, s + 1))
            start, acc = s + 1, 0
    if start < end:
        ranges.append((start, end))
    return ranges


def plan_batches(lengths, seq_ids, batch_tokens):
    """Group seq_ids into batches with padded B*T <= batch_tokens, longest first (a longer
    sequence than the budget goes alone). The order is deterministic."""
    order = sorted(seq_ids, key=lambda s: (-int(lengths[s]), s))
    batches = []
    for s in order:
        if batches and (len(batches[-1]) + 1) * int(lengths[batches[-1][0]]) <= batch_tokens:
            batches[-1].append(s)
        else:
            batches.append([s])
    return batches
