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

from eagle3lib.extract.shards import dequantize, plan_shards
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


def pack_val_rows(val_sequences: Iterator[Sequence], train_params) -> list[dict]:
    """The validation rows: packed rows, each a batch of one, until train.eval_max_tokens tokens."""
    rows, used = [], 0
    for row in pack_rows(val_sequences, train_params.max_seq_len):
        if used >= train_params.eval_max_tokens:
            break
        rows.append(make_batch([row], train_params.max_seq_len))
        used += rows[-1]["tokens"]
    return rows


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


def within_shard_order(items, seed: int, epoch: int, shard: int) -> list:
    """A shard's sequences in their seeded order of an epoch (the reader's, and online mode's per planned shard)."""
    items = list(items)
    random.Random(seed * 7919 + epoch * 31 + shard).shuffle(items)
    return items


def sequence_order(lengths: list[int], shard_max_tokens: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The order shard_sequences reads an uninterrupted extraction of sequences of these lengths in (shards planned
    as extract_with plans them, shard_max_tokens tokens each), as sequence indices: online mode trains in it,
    so that online and shards train on the same rows."""
    ranges = plan_shards(lengths, 0, len(lengths), shard_max_tokens)
    shard_ids = epoch_order(len(ranges), seed, epoch) if shuffle else range(len(ranges))
    order = []
    for i in shard_ids:
        seqs = range(*ranges[i])
        order += within_shard_order(seqs, seed, epoch, i) if shuffle else seqs
    return order


def shard_sequences(
    shards, seed: int, epoch: int, start: int = 0, shuffle: bool = True, prefetch: int = 0
) -> Iterator[Sequence]:
    """Sequences of a ShardSet, shards and sequences within a shard in a seeded order per epoch, from the
    start-th on (whole shards before it are not read).

    prefetch: shards loaded ahead in threads (reading and sha256 release the GIL). On an H200 a 1.2 GB
    shard took ~3 s to load and ~1.7 s to train on: without it the GPU idled for over half the run."""
    order = epoch_order(len(shards.shards), seed, epoch) if shuffle else list(range(len(shards.shards)))
    at = 0  # sequences of the epoch's order before the shard being read
    while order and at + shards.shards[order[0]]["sequences"] <= start:
        at += shards.shards[order.pop(0)]["sequences"]
    with ThreadPoolExecutor(max(1, prefetch)) as pool:
        pending = deque(pool.submit(shards.load, i) for i in order[:prefetch])
        for j, i in enumerate(order):
            t = pending.popleft().result() if pending else shards.load(i)
            if prefetch and j + prefetch < len(order):
                pending.append(pool.submit(shards.load, order[j + prefetch]))
            starts = t["seq_starts"].tolist()
            spans = list(zip(starts[:-1], starts[1:]))
            if shuffle:
                spans = within_shard_order(spans, seed, epoch, i)
            for a, b in spans:
                at += 1
                if at <= start:
                    continue
                scales = (t["aux_scale"][a:b], t["final_scale"][a:b]) if "aux_scale" in t else ()
                yield Sequence(
                    t["input_ids"][a:b], t["loss_mask"][a:b], t["aux_hidden"][a:b], t["final_hidden"][a:b], *scales
                )


def micro_batches(
    train_sequences: Callable[[int, int], Iterator[Sequence]],
    train_params,
    start_epoch: int,
    skip: int,
    start_sequence: int | None = None,
    depth: int | None = None,
) -> Iterator[tuple[int, int, dict]]:
    """(epoch, index in epoch, micro-batch) for the whole stream, made `depth` batches ahead in a background thread
    (default train_params.batch_prefetch; the copies release the GIL). train_sequences(epoch, start) yields an
    epoch's sequences from its start-th on. The stream starts in start_epoch at its start_sequence-th sequence
    with index `skip` (a resume's position: nothing before it is read or captured); without start_sequence (a
    checkpoint of an older version) it packs the epoch from its start and skips `skip` micro-batches. Each
    micro-batch holds `next_sequence`: the position in its epoch's order of the first sequence after it."""
    depth = train_params.batch_prefetch if depth is None else depth
    return in_background(_micro_batches(train_sequences, train_params, start_epoch, skip, start_sequence), depth)


def _micro_batches(
    train_sequences: Callable[[int, int], Iterator[Sequence]],
    train_params,
    start_epoch: int,
    skip: int,
    start_sequence: int | None,
) -> Iterator[tuple[int, int, dict]]:
    epoch, first = start_epoch, start_sequence or 0
    index = skip if start_sequence is not None else 0
    skip = 0 if start_sequence is not None else skip
    while True:
        rows = pack_rows(train_sequences(epoch, first), train_params.max_seq_len)
        chunk, made, at = [], 0, first
        for row in rows:
            chunk.append(row)
            at += len(row)
            if len(chunk) == train_params.batch_rows:
                if index >= skip:
                    batch = make_batch(chunk, train_params.max_seq_len)
                    batch["next_sequence"] = at
                    yield epoch, index, batch
                    made += 1
                index, chunk = index + 1, []
        if made == 0 and first == 0 and skip == 0:
            raise TrainingError("the training data yields no full batch: lower train.batch_rows or add data")
        epoch, first, index, skip = epoch + 1, 0, 0, 0


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
