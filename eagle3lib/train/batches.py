"""The input pipeline of training: sequences (from shards or the target, online), greedily packed into
rows, laid out as micro-batches and made ahead in a background thread."""

from __future__ import annotations

import queue
import random
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from eagle3lib.extract.shards import dequantize
from eagle3lib.train import TrainingError


@dataclass
class Sequence:
    input_ids: torch.Tensor  # [n] int
    loss_mask: torch.Tensor  # [n] uint8
    aux: torch.Tensor  # [n, 3H_t]
    final: torch.Tensor  # [n, H_t]
    # fp8 shards: the states stay e4m3 up to the device (half the bytes to copy), with their scales
    aux_scale: torch.Tensor | None = None  # [n, 3] float32
    final_scale: torch.Tensor | None = None  # [n, 1]

    def head(self, n: int) -> Sequence:
        """The first n tokens."""
        scales = (None, None) if self.aux_scale is None else (self.aux_scale[:n], self.final_scale[:n])
        return Sequence(self.input_ids[:n], self.loss_mask[:n], self.aux[:n], self.final[:n], *scales)


def pack_rows(sequences: Iterator[Sequence], max_seq_len: int) -> Iterator[list[Sequence]]:
    """Greedy packing of whole sequences (truncated to max_seq_len): the sequences of each row of at most
    max_seq_len tokens (make_batch lays rows out)."""
    row: list[Sequence] = []
    used = 0
    for seq in sequences:
        n = min(len(seq.input_ids), max_seq_len)
        if row and used + n > max_seq_len:
            yield row
            row, used = [], 0
        row.append(seq.head(n))
        used += n
    if row:
        yield row


def make_batch(rows: list[list[Sequence]], length: int) -> dict:
    """A micro-batch [B, length, ...] of packed rows, each row's padding at its end (doc_ids -1, zeros elsewhere).
    Each state is copied once, straight into place: at 4.6 KB a token (SmolLM2) a concatenate-pad-stack
    pipeline made three copies and held an H200's training steps waiting."""
    b, first = len(rows), rows[0][0]
    long = dict(dtype=torch.long)
    batch = {
        "input_ids": torch.zeros(b, length, **long),
        "loss_mask": torch.zeros(b, length, **long),
        "doc_ids": torch.full((b, length), -1, **long),
        "position_ids": torch.zeros(b, length, **long),
        "aux": torch.empty(b, length, first.aux.shape[-1], dtype=first.aux.dtype),
        "final": torch.empty(b, length, first.final.shape[-1], dtype=first.final.dtype),
    }
    keys = ["input_ids", "loss_mask", "aux", "final"]
    if first.aux_scale is not None:
        for key in ("aux_scale", "final_scale"):
            batch[key] = torch.zeros(b, length, getattr(first, key).shape[-1])
        keys += ["aux_scale", "final_scale"]
    tokens = 0
    for r, row in enumerate(rows):
        at = 0
        for d, s in enumerate(row):
            n = len(s.input_ids)
            for key in keys:
                batch[key][r, at : at + n] = getattr(s, key)
            batch["doc_ids"][r, at : at + n] = d
            batch["position_ids"][r, at : at + n] = torch.arange(n)
            at += n
        batch["aux"][r, at:] = 0  # fp8 too: its 0 is all-zero bits
        batch["final"][r, at:] = 0
        tokens += at
    batch["tokens"] = tokens
    return batch


def batch_to(batch: dict, device) -> dict:
    """A micro-batch on a device: its tensors, lists of tensors and layouts (anything with .to) moved."""

    def move(v):
        if isinstance(v, list):
            return [move(x) for x in v]
        return v.to(device) if hasattr(v, "to") else v

    return {k: move(v) for k, v in batch.items()}


def batch_states(batch: dict, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux, final) of a micro-batch in dtype, dequantized on its device when they came from fp8 shards."""
    if "aux_scale" not in batch:
        return batch["aux"].to(dtype), batch["final"].to(dtype)
    return dequantize(batch["aux"], batch["aux_scale"], dtype), dequantize(batch["final"], batch["final_scale"], dtype)


def epoch_order(num_items: int, seed: int, epoch: int) -> list[int]:
    order = list(range(num_items))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def shard_sequences(shards, seed: int, epoch: int, shuffle: bool = True, prefetch: int = 0) -> Iterator[Sequence]:
    """Sequences of a ShardSet, shards and sequences within a shard in a seeded order per epoch.

    prefetch: shards loaded ahead in threads (reading and sha256 release the GIL). On an H200 a 1.2 GB
    shard took ~3 s to load and ~1.7 s to train on: without it the GPU idled for over half the run."""
    order = epoch_order(len(shards.shards), seed, epoch) if shuffle else list(range(len(shards.shards)))
    with ThreadPoolExecutor(max(1, prefetch)) as pool:
        pending = deque(pool.submit(shards.load, i) for i in order[:prefetch])
        for j, i in enumerate(order):
            t = pending.popleft().result() if pending else shards.load(i)
            if prefetch and j + prefetch < len(order):
                pending.append(pool.submit(shards.load, order[j + prefetch]))
            starts = t["seq_starts"].tolist()
            spans = list(zip(starts[:-1], starts[1:]))
            if shuffle:
                random.Random(seed * 7919 + epoch * 31 + i).shuffle(spans)
            for a, b in spans:
                scales = (t["aux_scale"][a:b], t["final_scale"][a:b]) if "aux_scale" in t else ()
                yield Sequence(
                    t["input_ids"][a:b], t["loss_mask"][a:b], t["aux_hidden"][a:b], t["final_hidden"][a:b], *scales
                )


def online_sequences(model, tokens: dict, aux_layer_ids, seed: int, epoch: int, shuffle: bool = True):
    """Sequences with the target's states computed now (train.source: online), one forward each."""
    from eagle3lib.extract.hf import capture_hidden_states

    starts = tokens["seq_starts"].tolist()
    order = epoch_order(len(starts) - 1, seed, epoch) if shuffle else range(len(starts) - 1)
    device = next(model.parameters()).device
    for s in order:
        ids = tokens["input_ids"][starts[s] : starts[s + 1]].long()
        aux, final = capture_hidden_states(
            model, ids[None].to(device), torch.ones(1, len(ids), dtype=torch.long, device=device), aux_layer_ids
        )
        yield Sequence(ids, tokens["loss_mask"][starts[s] : starts[s + 1]], aux[0].cpu(), final[0].cpu())


def micro_batches(
    train_sequences: Callable[[int], Iterator[Sequence]], train_params, start_epoch: int, skip: int
) -> Iterator[tuple[int, int, dict]]:
    """(epoch, index in epoch, micro-batch) for the whole stream, skipping `skip` of the first epoch;
    made train_params.batch_prefetch batches ahead in a background thread (the copies release the GIL)."""
    return in_background(_micro_batches(train_sequences, train_params, start_epoch, skip), train_params.batch_prefetch)


def _micro_batches(
    train_sequences: Callable[[int], Iterator[Sequence]], train_params, start_epoch: int, skip: int
) -> Iterator[tuple[int, int, dict]]:
    epoch = start_epoch
    while True:
        rows = pack_rows(train_sequences(epoch), train_params.max_seq_len)
        index, chunk = 0, []
        for row in rows:
            chunk.append(row)
            if len(chunk) == train_params.batch_rows:
                if index >= skip:
                    yield epoch, index, make_batch(chunk, train_params.max_seq_len)
                index, chunk = index + 1, []
        if index == 0 and skip == 0:
            raise TrainingError("the training data yields no full batch: lower train.batch_rows or add data")
        epoch, skip = epoch + 1, 0


class _Raised:
    def __init__(self, error: BaseException):
        self.error = error


def in_background(items: Iterator, depth: int) -> Iterator:
    """The items of an iterator, in order, made up to `depth` ahead in a daemon thread; an error raised
    there is raised here. Closing this generator stops the thread and closes `items` there."""
    if depth <= 0:
        yield from items
        return
    made, stop, end = queue.Queue(depth), threading.Event(), object()

    def put(x) -> bool:
        while not stop.is_set():
            try:
                made.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work():
        try:
            for x in items:
                if not put(x):
                    return
            put(end)
        except BaseException as e:  # noqa: BLE001 (re-raised in the consumer)
            put(_Raised(e))
        finally:
            close = getattr(items, "close", None)
            if close:
                close()

    worker = threading.Thread(target=work, name="eagle3-batches", daemon=True)
    worker.start()
    try:
        while True:
            x = made.get()
            if x is end:
                return
            if isinstance(x, _Raised):
                raise x.error
            yield x
    finally:
        stop.set()
        worker.join()
