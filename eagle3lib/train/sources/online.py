"""Online training (train.source: online): the target's states are captured while the drafter trains and handed
to it through a bounded queue, never written (docs/design.md §8, online mode).

    states, contract = load_states(p)                       # extract.backend's capture: sequences -> (aux, final)
    data = OnlineData(states, tokens, seed, max_seq_len, shard_max_tokens)
    data.train_sequences(epoch, start)                      # what micro_batches packs, in the shards' order

The capture runs in a thread of the trainer's process (online_placement: thread, the queue is in_background's)
or in a process of its own that sends the micro-batches (online_placement: process, train/sources/process.py), or in a
Ray actor whose micro-batches go through Ray's object store (online_placement: ray, train/sources/ray_actors.py). Every
way the producer is a StateSource: HFStates (`hf`, any placement, the CPU too), or EngineStates (`sglang_inprocess`,
GPU hosts: SGLang's model runner in a thread of the one trainer process or in the capture process, in SGLang's
interpreter, extract/sglang_inprocess.py).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Protocol

import torch

from eagle3lib.extract.shards import CaptureHere
from eagle3lib.train.runtime.batches import Sequence, sequence_order

CACHE_DIR = "states/train"  # under 02_train: online_cache_first_epoch's shards


class StateSource(Protocol):
    """A capture backend as online training drives it.

    capture(sequences)  -> [(aux [n, k*H], final [n, H])] on the CPU, one per id tensor, in order
    batch_tokens        tokens per capture call (the producer groups consecutive sequences up to it): padded
                        tokens, or with `ragged = True` (a source that packs sequences without padding) real ones
    close()             optional: what the source holds (an engine's ranks) is let go
    """

    batch_tokens: int

    def capture(self, sequences: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


class HFStates:
    """The hf backend as a StateSource: one forward of the Hugging Face target per group of sequences."""

    name = "hf"
    ragged = False

    def __init__(self, model, aux_layer_ids, batch_tokens: int):
        self.model, self.aux_layer_ids, self.batch_tokens = model, [int(i) for i in aux_layer_ids], batch_tokens

    def capture(self, sequences):
        from eagle3lib.extract.hf import capture_sequences

        return capture_sequences(self.model, sequences, self.aux_layer_ids)


class OnlineData:
    """One split's sequences with their states captured as they are read, and what the capture cost
    (`stats`: sequences and tokens captured, seconds, the first position captured)."""

    def __init__(
        self,
        states: StateSource,
        tokens: dict,
        seed: int,
        max_seq_len: int,
        shard_max_tokens: int,
        cache: FirstEpochCache | None = None,
    ):
        self.states, self.tokens, self.seed, self.cache = states, tokens, seed, cache
        # the packer cuts a sequence to max_seq_len and the states of a prefix are the prefix's: only that much is
        # captured, unless the whole sequence goes into the cache's shards
        self.max_seq_len = None if cache else max_seq_len
        self.shard_max_tokens = shard_max_tokens
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
        if self.cache is None:
            return self.sequences(self.order(epoch)[start:])
        if epoch == 0:
            return self.cache.written(self.sequences(self.order(epoch)[start:]), self.order(epoch)[start:])
        return self.cache.read(self, epoch, start)

    def val_sequences(self) -> Iterator[Sequence]:
        return self.sequences(range(len(self.lengths)))

    def sequences(self, seq_ids) -> Iterator[Sequence]:
        """These sequences, each cut to max_seq_len (the packer's cut: the states of a prefix are the prefix's
        states), captured in groups of consecutive ones of at most batch_tokens tokens (shards.plan_batches)."""
        from eagle3lib.extract.shards import plan_batches

        starts, ragged = self.tokens["seq_starts"], getattr(self.states, "ragged", False)
        cut = [min(n, self.max_seq_len or n) for n in self.lengths]
        for group in plan_batches(cut, seq_ids, self.states.batch_tokens, ragged=ragged, in_order=True):
            yield from self._captured([(int(starts[s]), cut[s]) for s in group])

    def close(self) -> None:
        getattr(self.states, "close", lambda: None)()

    def _captured(self, group: list[tuple[int, int]]) -> Iterator[Sequence]:
        ids = [self.tokens["input_ids"][a : a + n].long() for a, n in group]
        t = time.perf_counter()
        got = self.states.capture(ids)
        self.stats["capture_s"] += time.perf_counter() - t
        self.stats["sequences"] += len(group)
        self.stats["tokens"] += sum(n for _, n in group)
        for (a, n), seq_ids, (aux, final) in zip(group, ids, got, strict=True):
            yield Sequence(seq_ids, self.tokens["loss_mask"][a : a + n], aux, final)


class FirstEpochCache:
    """train.online_cache_first_epoch: the first epoch's states also written, as the extraction 01_extract would
    make of the training tokens (the same shards, planned by extract.shard_max_tokens, in extract.store_dtype,
    with manifest and contract), and read back by shard_sequences in later epochs, as speculators does. Epoch 0
    captures the shards in turn (online's order is the reader's: a shard's sequences come one after the other),
    so each is written once its last sequence is captured. A run resumed within epoch 0 misses the shard it was
    in: before epoch 1 the cache is finished by extract_with, which captures exactly what is not listed."""

    def __init__(self, out_dir, tokens: dict, contract: dict, store_dtype, shard_max_tokens: int, batch_tokens: int):
        from eagle3lib.extract import shards

        self.out_dir, self.contract = Path(out_dir), contract
        self.tok = shards.as_token_tensors(tokens)
        self.layout = shards.ShardLayout(store_dtype, shard_max_tokens, batch_tokens)

    def _writer(self):
        """The cache's folder opened for writing (its bad or unlisted shards dropped: their sequences are redone)."""
        from eagle3lib.extract import shards

        aux_ids, hidden_size = self.contract["aux_layer_ids"], self.contract["hidden_size"]
        writer = shards.ShardWriter(
            self.out_dir, self.tok, self.contract, self.layout, aux_ids, hidden_size, check_sha256=False
        )
        for name, why in writer.dropped:
            print(f"dropped {name}, its sequences will be redone: {why}")
        return writer

    def written(self, sequences: Iterator[Sequence], seq_ids: list[int]) -> Iterator[Sequence]:
        """The sequences, passed on as they come; each planned shard whose sequences all came is written (in a
        thread, one at a time: the capture goes on meanwhile)."""
        writer = self._writer()
        listed = writer.listed()
        shard_of = {s: (first, end) for first, end in writer.plan() for s in range(first, end)}
        held: dict[tuple[int, int], dict[int, Sequence]] = {}
        with writer:
            for s, seq in zip(seq_ids, sequences, strict=True):
                first, end = shard_of[s]
                if first not in listed:
                    held.setdefault((first, end), {})[s] = seq
                    if len(held[(first, end)]) == end - first:
                        writer.put(first, end, partial(_joined_states, held.pop((first, end)), first, end))
                yield seq

    def read(self, data: OnlineData, epoch: int, start: int) -> Iterator[Sequence]:
        """Epoch `epoch` (>= 1) from the cache, finished first where epoch 0 left shards out (a resume within it)."""
        from eagle3lib.extract import shards
        from eagle3lib.train.runtime.batches import shard_sequences

        if not self._writer().manifest["complete"]:
            shards.extract_with(
                _SourceCapture(data.states, self.contract),
                self.tok,
                self.contract["aux_layer_ids"],
                self.out_dir,
                self.contract,
                self.layout,
                progress=False,
                verify_existing=False,
            )
        return shard_sequences(shards.ShardSet(self.out_dir), data.seed, epoch, start)


def _joined_states(held: dict[int, Sequence], first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux, final) of sequences [first, end) in token order, from their captured Sequences."""
    return torch.cat([held[s].aux for s in range(first, end)]), torch.cat([held[s].final for s in range(first, end)])


class _SourceCapture(CaptureHere):
    """A StateSource as extract_with's Capture (shards.Capture), to finish a first-epoch cache."""

    name = "online"

    def __init__(self, states: StateSource, contract: dict):
        self.states, self.hidden_size, self.vocab_size = states, contract["hidden_size"], contract["vocab_size"]

    def shard(self, tok, lengths, first, end, store_dtype, bar):
        from eagle3lib.extract.shards import plan_batches

        starts = tok["seq_starts"]
        seqs = {s: tok["input_ids"][int(starts[s]) : int(starts[s + 1])].long() for s in range(first, end)}
        ragged = getattr(self.states, "ragged", False)
        groups = plan_batches(lengths, range(first, end), self.states.batch_tokens, ragged=ragged, in_order=True)
        got = [pair for g in groups for pair in self.states.capture([seqs[s] for s in g])]
        bar.update(sum(len(seq) for seq in seqs.values()))
        return torch.cat([a for a, _ in got]).to(store_dtype), torch.cat([f for _, f in got]).to(store_dtype)


def capture_contract(p, model_or_info, tokenizer) -> dict:
    """The states' contract as 01_extract would write it for this target (dtype: the target's, the states are
    handed over as the target computes them)."""
    from eagle3lib import target

    aux_ids = target.aux_layer_ids(p.target.aux_layer_ids, target.num_layers(model_or_info.config))
    return target.make_contract(p.target.name, model_or_info, tokenizer, aux_ids, p.target.dtype)


def contract_without_weights(p) -> dict:
    """The states' contract for a trainer that captures nothing itself (a capture process or actor sends them):
    from the target's config and tokenizer, no weights loaded."""
    from eagle3lib import target
    from eagle3lib.params import cache_dir

    target_dir = target.resolve_target(p.target.name, cache_dir(p))
    info, tokenizer = target.load_target_info(target_dir, cache_dir(p), p.target.trust_remote_code)
    return capture_contract(p, info, tokenizer)


def load_states(p) -> tuple[StateSource, dict]:
    """(the params' capture backend as a StateSource, the states' contract), the target loaded in this process:
    hf, the Hugging Face model; sglang_inprocess, SGLang's model runner (this process must be SGLang's
    interpreter: launch.launch starts the stage there), its tensor-parallel ranks beside it."""
    from eagle3lib import target
    from eagle3lib.params import cache_dir

    if p.extract.backend == "sglang_inprocess":
        import importlib.util

        from eagle3lib.extract import sglang_inprocess
        from eagle3lib.extract.backends import engine_settings

        if importlib.util.find_spec("sglang") is None:
            raise ModuleNotFoundError(
                "train.source: online with extract.backend sglang_inprocess captures with SGLang in this process "
                f"(the trainer's, or the capture process), and this interpreter ({sys.executable}) has no sglang: "
                "start the stage with launch.launch (the 02_train notebook and `python -m eagle3lib run` do: it "
                "runs the capture in engine.python), or set extract.backend: hf"
            )
        target_dir = target.resolve_target(p.target.name, cache_dir(p))
        info, tokenizer = target.load_target_info(
            target_dir, cache_dir(p), trust_remote_code=p.target.trust_remote_code
        )
        contract = capture_contract(p, info, tokenizer)
        flags = engine_settings(p, "sglang")["extra_args"]
        engine = sglang_inprocess.Engine(target_dir, contract["aux_layer_ids"], p.target.dtype, flags)
        return sglang_inprocess.EngineStates(engine, p.extract.batch_tokens), contract
    model, tokenizer = target.load_target(
        p.target.name,
        cache_dir(p),
        dtype=p.target.dtype,
        device=p.target.device,
        trust_remote_code=p.target.trust_remote_code,
    )
    contract = capture_contract(p, model, tokenizer)
    return HFStates(model, contract["aux_layer_ids"], p.extract.batch_tokens), contract


def capture_setup(
    p, train_tokens: dict, val_tokens: dict, train_dir: Path, loaded: tuple | None = None
) -> tuple[OnlineData, OnlineData, dict]:
    """(train data, val data, contract) capturing through the params' backend in this process (load_states, or
    `loaded`, what it returned: a capture shared by several runs); with train.online_cache_first_epoch the first
    epoch's states go to train_dir/CACHE_DIR."""
    from eagle3lib import target

    states, contract = loaded or load_states(p)
    max_len, shard_max = p.train.max_seq_len, p.extract.shard_max_tokens
    cache = None
    if p.train.online_cache_first_epoch:
        store = target.torch_dtype(p.extract.store_dtype)
        shard_contract = contract | {"dtype": p.extract.store_dtype}  # as 01_extract's eagle3.json says it
        cache = FirstEpochCache(
            Path(train_dir) / CACHE_DIR, train_tokens, shard_contract, store, shard_max, states.batch_tokens
        )
    train = OnlineData(states, train_tokens, p.run.seed, max_len, shard_max, cache)
    val = OnlineData(states, val_tokens, p.run.seed, max_len, shard_max)
    return train, val, contract


def online_stats(data) -> dict:
    """What this process's capture did: sequences and tokens captured, its seconds and rate, where it started."""
    st = data.stats
    rate = st["tokens"] / st["capture_s"] if st["capture_s"] else None
    return {**st, "capture_s": round(st["capture_s"], 2), "capture_tokens_per_s": rate and round(rate, 1)}
