"""The plan of an extraction: its layout (ShardLayout, recorded in the manifest), the shard boundaries and the
batches, a pure function of the sequence lengths and the budgets, so that a run killed at any point and restarted
computes exactly the batches the uninterrupted run would have."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from eagle3lib.extract.shards.format import default_shard_max_tokens


@dataclass(frozen=True)
class ShardLayout:
    """How an extraction lays its states out: the store dtype, the tokens at which a shard closes (None: about
    1 GiB a shard) and the tokens of a backend's batch (plan_batches' budget)."""

    store_dtype: torch.dtype = torch.bfloat16
    shard_max_tokens: int | None = None
    batch_tokens: int = 4096

    def sized_for(self, hidden_size: int, n_aux: int) -> ShardLayout:
        """This layout with shard_max_tokens given, about 1 GiB of these states a shard where it is None."""
        default = default_shard_max_tokens(hidden_size, self.store_dtype, n_aux)
        return replace(self, shard_max_tokens=self.shard_max_tokens or default)


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


def plan_batches(lengths, seq_ids, batch_tokens, *, ragged=False, in_order=False) -> list[list[int]]:
    """seq_ids (indices into lengths) in groups of at most batch_tokens tokens, one capture call or forward each: a
    group costs len(group) x its longest (padded), or with `ragged` the sum of its lengths (packed without padding).
    Longest first, ties by id, or with `in_order` consecutive in the given order; a sequence longer than the
    budget goes alone."""
    order = list(seq_ids) if in_order else sorted(seq_ids, key=lambda s: (-int(lengths[s]), s))
    groups, longest, used = [], 0, 0
    for s in order:
        n = int(lengths[s])
        if groups and (used + n if ragged else (len(groups[-1]) + 1) * max(longest, n)) <= batch_tokens:
            groups[-1].append(s)
            longest, used = max(longest, n), used + n
        else:
            groups.append([s])
            longest, used = n, n
    return groups
