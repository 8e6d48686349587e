"""Online training (train.source: online): the target's states are captured while the drafter trains and handed
to it through a bounded queue, never written (docs/design.md §8, online mode).

    states = HFStates(model, aux_ids, batch_tokens)        # a capture backend: sequences -> (aux, final)
    data = OnlineData(states, tokens, seed, max_seq_len, shard_max_tokens)
    data.train_sequences(epoch, start)                      # what micro_batches packs, in the shards' order

The capture runs in a thread of the trainer's process (online_placement: thread, the queue is in_background's)
or in a process of its own that sends the micro-batches (online_placement: process, train/placement.py). Either
way the producer is a StateSource: `hf` here and on the CPU; `sglang_inprocess` on GPUs plugs in as another one
(its model runner's prefill returns the same aux and final states, extract/sglang_inprocess.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Protocol

import torch

from eagle3lib.train.batches import Sequence, sequence_order


class StateSource(Protocol):
    """A capture backend as online training drives it.

    capture(sequences)  -> [(aux [n, k*H], final [n, H])] on the CPU, one per id tensor, in order
    batch_tokens        padded tokens per capture call (the producer groups consecutive sequences up to it)
    """

    batch_tokens: int

    def capture(self, sequences: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


class HFStates:
    """The hf backend as a StateSource: one forward of the Hugging Face target per group of sequences."""

    name = "hf"

    def __init__(self, model, aux_layer_ids, batch_tokens: int):
        self.model, self.aux_layer_ids, self.batch_tokens = model, [int(i) for i in aux_layer_ids], batch_tokens

    def capture(self, sequences):
        from eagle3lib.extract.hf import capture_sequences

        return capture_sequences(self.model, sequences, self.aux_layer_ids)


class OnlineData:
    """One split's sequences with their states captured as they are read, and what the capture cost
    (`stats`: sequences and tokens captured, seconds, the first position captured)."""

    def __init__(self, states: StateSource, tokens: dict, seed: int, max_seq_len: int, shard_max_tokens: int):
        self.states, self.tokens, self.seed = states, tokens, seed
        self.max_seq_len, self.shard_max_tokens = max_seq_len, shard_max_tokens
        starts = tokens["seq_starts"]
        self.lengths = (starts[1:] - starts[:-1]).tolist()
        self.stats = {"sequences": 0, "tokens": 0, "capture_s": 0.0, "started_at": None}

    def order(self, epoch: int, shuffle: bool = True) -> list[int]:
        """The epoch's order of sequence indices: the one shard_sequences reads an extraction of these tokens in."""
        return sequence_order(self.lengths, self.shard_max_tokens, self.seed, epoch, shuffle)

    def train_sequences(self, epoch: int, start: int = 0) -> Iterator[Sequence]:
        """The epoch's sequences from position `start` of its order on (nothing before it is captured)."""
        if self.stats["started_at"] is None:
            self.stats["started_at"] = {"epoch": epoch, "sequence": start}
        return self.sequences(self.order(epoch)[start:])

    def val_sequences(self) -> Iterator[Sequence]:
        return self.sequences(range(len(self.lengths)))

    def sequences(self, seq_ids) -> Iterator[Sequence]:
        """These sequences, each cut to max_seq_len (the packer's cut: the states of a prefix are the prefix's
        states), captured in groups of consecutive ones of at most batch_tokens padded tokens."""
        starts = self.tokens["seq_starts"]
        group, longest = [], 0
        for s in seq_ids:
            a = int(starts[s])
            n = min(self.lengths[s], self.max_seq_len)
            if group and (len(group) + 1) * max(longest, n) > self.states.batch_tokens:
                yield from self._captured(group)
                group, longest = [], 0
            group.append((a, n))
            longest = max(longest, n)
        if group:
            yield from self._captured(group)

    def _captured(self, group: list[tuple[int, int]]) -> Iterator[Sequence]:
        ids = [self.tokens["input_ids"][a : a + n].long() for a, n in group]
        t = time.perf_counter()
        got = self.states.capture(ids)
        self.stats["capture_s"] += time.perf_counter() - t
        self.stats["sequences"] += len(group)
        self.stats["tokens"] += sum(n for _, n in group)
        for (a, n), seq_ids, (aux, final) in zip(group, ids, got, strict=True):
            yield Sequence(seq_ids, self.tokens["loss_mask"][a : a + n], aux, final)


def capture_contract(p, model_or_info, tokenizer) -> dict:
    """The states' contract as 01_extract would write it for this target (dtype: the target's, the states are
    handed over as the target computes them)."""
    from eagle3lib import target

    aux_ids = target.aux_layer_ids(p.target.aux_layer_ids, target.num_layers(model_or_info.config))
    return target.make_contract(p.target.name, model_or_info, tokenizer, aux_ids, p.target.dtype)


def capture_setup(p, train_tokens: dict, val_tokens: dict) -> tuple[OnlineData, OnlineData, dict]:
    """The target loaded in this process (extract.backend hf: the only capture backend that runs in the trainer's
    process) and (train data, val data, contract) capturing through it."""
    from eagle3lib import target
    from eagle3lib.params import cache_dir

    if p.extract.backend != "hf":
        raise ValueError(
            f"train.source: online captures with extract.backend 'hf' in this host's processes; "
            f"{p.extract.backend!r} is not wired to online training yet: set extract.backend: hf, or train from "
            "its shards (train.source: shards)"
        )
    model, tokenizer = target.load_target(
        p.target.name,
        cache_dir(p),
        dtype=p.target.dtype,
        device=p.target.device,
        trust_remote_code=p.target.trust_remote_code,
    )
    contract = capture_contract(p, model, tokenizer)
    states = HFStates(model, contract["aux_layer_ids"], p.extract.batch_tokens)
    max_len, shard_max = p.train.max_seq_len, p.extract.shard_max_tokens
    train = OnlineData(states, train_tokens, p.run.seed, max_len, shard_max)
    val = OnlineData(states, val_tokens, p.run.seed, max_len, shard_max)
    return train, val, contract


def online_stats(data) -> dict:
    """What this process's capture did: sequences and tokens captured, its seconds and rate, where it started."""
    st = data.stats
    rate = st["tokens"] / st["capture_s"] if st["capture_s"] else None
    return {**st, "capture_s": round(st["capture_s"], 2), "capture_tokens_per_s": rate and round(rate, 1)}
