"""The one writer every backend goes through: ShardWriter assembles and writes the shards of one extraction folder,
and extract_with drives a backend (a Capture: hf.HFCapture, vllm.VLLMCapture, sglang.SGLangCapture,
sglang_inprocess) through it, resuming where an earlier call stopped. Online training's first-epoch cache writes
through a ShardWriter too.

A shard holds whole sequences; shard boundaries and batches are a pure function of the sequence lengths,
shard_max_tokens and batch_tokens (plan.py), so a run killed at any point and restarted computes exactly the
batches the uninterrupted run would have and ends with byte-identical shards. Every file is written to a temp
name, fsynced and renamed (files.py); a shard counts once the manifest lists it (manifest.py).
"""

from __future__ import annotations

import os
import shutil
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol, runtime_checkable

from tqdm.auto import tqdm

from eagle3lib.extract.shards.dtypes import capture_dtype, store_states
from eagle3lib.extract.shards.files import write_json
from eagle3lib.extract.shards.format import bytes_per_token, shard_name, write_shard
from eagle3lib.extract.shards.manifest import (
    MANIFEST,
    begin_manifest,
    check_contract_file,
    list_shard,
    load_manifest,
    missing_ranges,
    verify_and_repair,
)
from eagle3lib.extract.shards.plan import ShardLayout, plan_shards
from eagle3lib.extract.shards.tokens import as_token_tensors
from eagle3lib.run_folder import writing


@runtime_checkable
class Capture(Protocol):
    """A backend of extract_with: hf.HFCapture (the reference), vllm.VLLMCapture, sglang.SGLangCapture.

    name, hidden_size, vocab_size       what the shards and the input check need
    with capture: ...                   an engine that can stays up across the extract_with calls inside
    session(tok, lengths, plan, out_dir)
                                        context manager around all shards of one call (engines start there)
    shard(tok, lengths, first, end, dtype, bar)
                                        -> (aux [n, k*H], final [n, H]) in dtype (capture_dtype(store dtype)),
                                        in token order, or store_states' dict made on the backend's device;
                                        new tensors each call (the writer thread still holds the last ones)
    stats()                             this call's backend figures (engine start, plain prefill, ...); its
                                        `excluded_s` is session time that is not capture (start-up, checks)
    """

    name: str
    hidden_size: int
    vocab_size: int

    def __enter__(self): ...

    def __exit__(self, *exc): ...

    def session(self, tok: dict, lengths: list[int], plan: list, out_dir) -> AbstractContextManager: ...

    def shard(self, tok: dict, lengths: list[int], first: int, end: int, store_dtype, bar) -> tuple: ...

    def stats(self) -> dict: ...


class CaptureHere:
    """What a Capture that runs in this process with nothing to start (no engine, no session) has of the protocol:
    `with capture:` and session() do nothing, stats() has no figures. Its subclass gives name, sizes and shard()."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def session(self, tok, lengths, plan, out_dir):
        return nullcontext()

    def stats(self) -> dict:
        return {}


class ShardWriter:
    """One extraction folder being written: opened for these tokens and settings (the contract checked, the manifest
    begun or resumed, bad and unlisted shards dropped), then shards put one by one, each written (bytes, sha256,
    fsync) in a thread while the caller goes on and listed in the manifest once its file is complete on disk.

        writer = ShardWriter(out_dir, tokens, contract, layout, aux_layer_ids, hidden_size)
        with writer:                                     # on leaving: waits for the writes and lists them
            for first, end in writer.missing():
                writer.put(first, end, (aux, final))     # the states of sequences [first, end), in token order
        writer.complete()

    dropped: [(file, why)] of the shards dropped on opening (their sequences are missing again).
    """

    def __init__(
        self,
        out_dir,
        tokens,
        contract,
        layout: ShardLayout,
        aux_layer_ids,
        hidden_size,
        *,
        check_sha256=True,
        writers=1,
    ):
        """check_sha256=False checks existing shards by size instead of sha256; writers: shards written at once."""
        self.out_dir, self.tok = out_dir, as_token_tensors(tokens)
        self.aux_layer_ids, self.hidden_size = [int(i) for i in aux_layer_ids], int(hidden_size)
        self.layout = layout.sized_for(hidden_size, len(self.aux_layer_ids))
        starts = self.tok["seq_starts"]
        self.lengths = (starts[1:] - starts[:-1]).tolist()
        os.makedirs(out_dir, exist_ok=True)
        check_contract_file(out_dir, contract)
        begin_manifest(out_dir, self.tok, self.aux_layer_ids, self.hidden_size, self.layout)
        self.dropped = verify_and_repair(out_dir, check_sha256=check_sha256)
        self.manifest = load_manifest(out_dir)
        self.writers, self.write_wait_s = max(1, writers), 0.0
        self._pool, self._pending = None, deque()

    def plan(self) -> list[tuple[int, int]]:
        """Every shard's sequences [first, end), in order."""
        return plan_shards(self.lengths, 0, len(self.lengths), self.layout.shard_max_tokens)

    def listed(self) -> set[int]:
        """The first sequence of every shard the manifest lists."""
        return {e["first_sequence"] for e in self.manifest["shards"]}

    def missing(self) -> list[tuple[int, int]]:
        """The shards [first, end) still to write: the sequences no listed shard holds, planned into shards."""
        size = self.layout.shard_max_tokens
        return [r for a, b in missing_ranges(self.manifest) for r in plan_shards(self.lengths, a, b, size)]

    def __enter__(self):
        self._pool = ThreadPoolExecutor(self.writers)
        return self

    def __exit__(self, exc_type, *exc):
        try:
            while self._pending and exc_type is None:  # after an error the writes finish unlisted (stray files)
                self._list(self._pending.popleft())
        finally:
            self._pending.clear()
            self._pool.shutdown(wait=True)
        return False

    def put(self, first: int, end: int, states) -> None:
        """The shard of sequences [first, end), written in a thread and listed once complete (while `writers`
        writes are in flight, the oldest is waited for first). states: (aux [n, k*H], final [n, H]) in token
        order or store_states' dict, both new tensors (the write still reads them after put returns), made into
        the shard's tensors here; or a function returning either, called in the writer thread."""
        tensors = states if callable(states) else self._shard_tensors(first, end, states)
        while len(self._pending) >= self.writers:
            self._list(self._pending.popleft())
        self._pending.append(self._pool.submit(self._write, first, end, tensors))

    def complete(self) -> None:
        """Mark the extraction complete in its manifest (every shard listed)."""
        if not self.manifest["complete"]:
            self.manifest["complete"] = True
            with writing(os.path.join(self.out_dir, MANIFEST)):
                write_json(os.path.join(self.out_dir, MANIFEST), self.manifest)

    def _shard_tensors(self, first, end, states) -> dict:
        """The tensors of the shard holding sequences [first, end), from their states in token order."""
        if not isinstance(states, dict):
            states = store_states(*states, len(self.aux_layer_ids), self.layout.store_dtype)
        starts = self.tok["seq_starts"]
        base, n = int(starts[first]), int(starts[end] - starts[first])
        rows = {k: v.shape[0] for k, v in states.items()}
        if any(r != n for r in rows.values()):
            raise ValueError(
                f"sequences {first}..{end - 1} have {n} tokens, the backend returned rows {rows}; expected one row "
                f"per token"
            )
        return {
            "input_ids": self.tok["input_ids"][base : base + n].clone(),
            "loss_mask": self.tok["loss_mask"][base : base + n].clone(),
            **{k: v.cpu() for k, v in states.items()},
            "seq_starts": starts[first : end + 1] - base,
        }

    def _write(self, first, end, tensors) -> dict:
        if callable(tensors):
            tensors = self._shard_tensors(first, end, tensors())
        with writing(os.path.join(self.out_dir, shard_name(first))):  # a full disk names the shard
            return write_shard(self.out_dir, tensors, first, self.aux_layer_ids)

    def _list(self, pending) -> None:
        t = time.perf_counter()
        entry = pending.result()
        self.write_wait_s += time.perf_counter() - t
        with writing(os.path.join(self.out_dir, MANIFEST)):
            list_shard(self.out_dir, self.manifest, entry)


def extract_with(
    capture: Capture,
    tokens,
    aux_layer_ids,
    out_dir,
    contract,
    layout: ShardLayout | None = None,
    *,
    progress=True,
    free_bytes=None,
    verify_existing=True,
    writers=2,
):
    """Capture aux + final hidden states for every sequence through `capture` (a backend, see Capture)
    and write them as shards laid out as `layout` says (None: ShardLayout()'s defaults; its batch_tokens is recorded
    in the manifest, the backends take theirs when made).

    Resumes where an earlier call stopped (killed or not): shards the manifest lists and that
    verify are kept, bad or unlisted ones are redone. A complete extraction is not redone.
    free_bytes overrides the free disk space (for tests). verify_existing=False checks existing shards by size
    instead of sha256. writers: shards written (bytes, sha256, fsync) at once in threads while the next one is
    captured.

    Returns {backend, sequences, tokens (done in this call), total_sequences, total_tokens, shards,
    bytes (all shards on disk), bytes_per_token, seconds, tokens_per_s (this call's capture+write,
    engine start-up excluded), complete, capture_s, write_wait_s (capture waiting for the writer)} plus the
    backend's stats() (engine start, plain prefill...).
    """
    tok = as_token_tensors(tokens)
    _check_inputs(capture, tok, aux_layer_ids, contract)
    layout, hidden_size = layout or ShardLayout(), int(capture.hidden_size)
    options = dict(check_sha256=verify_existing, writers=writers)
    writer = ShardWriter(out_dir, tok, contract, layout, aux_layer_ids, hidden_size, **options)
    for name, why in writer.dropped:
        print(f"extract: dropped {name}, will redo its sequences: {why}")
    plan = writer.missing()
    starts = tok["seq_starts"]
    todo_tokens = sum(int(starts[b] - starts[a]) for a, b in plan)
    seconds, stats = 0.0, {}
    if plan:
        _check_disk_space(capture.name, writer, plan, todo_tokens, free_bytes)
        seconds, stats = _capture_shards(capture, writer, plan, todo_tokens, progress)
    writer.complete()
    manifest = writer.manifest
    total_bytes = sum(e["bytes"] for e in manifest["shards"])
    return {
        "backend": capture.name,
        "sequences": sum(b - a for a, b in plan),
        "tokens": todo_tokens,
        "total_sequences": manifest["num_sequences"],
        "total_tokens": manifest["num_tokens"],
        "shards": len(manifest["shards"]),
        "bytes": total_bytes,
        "bytes_per_token": total_bytes / max(1, manifest["num_tokens"]),
        "seconds": seconds,
        "tokens_per_s": todo_tokens / seconds if plan and seconds > 0 else None,
        "complete": True,
        **stats,
    }


def _check_inputs(capture, tok, aux_layer_ids, contract) -> None:
    vocab, hidden_size = int(capture.vocab_size), int(capture.hidden_size)
    for key, have in (("aux_layer_ids", [int(i) for i in aux_layer_ids]), ("hidden_size", hidden_size)):
        if key in contract and contract[key] != have:
            raise ValueError(
                f"contract[{key!r}] is {contract[key]!r} but this extraction has {have!r} (from the "
                f"arguments and the model); build the contract from the same target and aux ids"
            )
    if tok["input_ids"].numel() and (tok["input_ids"].min() < 0 or tok["input_ids"].max() >= vocab):
        raise ValueError(
            f"tokens: ids range {int(tok['input_ids'].min())}..{int(tok['input_ids'].max())}, expected "
            f"0..{vocab - 1} (the target's vocab_size); were these tokenized for another model?"
        )


def _check_disk_space(backend, writer: ShardWriter, plan, todo_tokens, free_bytes) -> None:
    per_token = bytes_per_token(writer.hidden_size, writer.layout.store_dtype, len(writer.aux_layer_ids))
    need = todo_tokens * per_token + 4096 * len(plan) + 2**16
    out_dir = writer.out_dir
    free = shutil.disk_usage(out_dir).free if free_bytes is None else free_bytes
    print(
        f"extract ({backend}): {sum(b - a for a, b in plan):,} sequences, {todo_tokens:,} tokens to do in "
        f"{len(plan)} shards; needs ~{need / 1e9:.3f} GB ({need:,} bytes), {free:,} bytes free in {out_dir}"
    )
    if free < need:
        raise OSError(
            f"not enough disk space in {out_dir}: the remaining shards need ~{need:,} bytes, "
            f"{free:,} bytes are free; free space, pick another out_dir, or extract fewer tokens"
        )


def _capture_shards(capture, writer: ShardWriter, plan, todo_tokens, progress) -> tuple[float, dict]:
    """Every planned shard captured and put to the writer; (seconds of capture and write, engine start-up
    excluded; the capture's stats with capture_s and write_wait_s)."""
    t0, capture_s = time.perf_counter(), 0.0
    tok, lengths, dtype = writer.tok, writer.lengths, capture_dtype(writer.layout.store_dtype)
    # Shards are written (bytes, sha256, fsync: ~3 s a GB) in threads while the next one is captured;
    # on an H200 the synchronous write held the hf backend to 0.11 of the target's forward.
    with (
        tqdm(total=todo_tokens, unit="tok", unit_scale=True, disable=not progress, desc="extract") as bar,
        capture.session(tok, lengths, plan, writer.out_dir),
        writer,
    ):
        for first, end in plan:
            t, waited = time.perf_counter(), writer.write_wait_s
            # backends return new tensors per shard, so the next capture cannot overwrite these
            writer.put(first, end, capture.shard(tok, lengths, first, end, dtype, bar))
            capture_s += time.perf_counter() - t - (writer.write_wait_s - waited)
    waits = {"capture_s": capture_s, "write_wait_s": writer.write_wait_s}
    stats = {**capture.stats(), **{k: round(v, 2) for k, v in waits.items()}}
    # Engine start-up (loading the target, spawning workers) is reported apart, not as capture time.
    seconds = time.perf_counter() - t0 - stats.get("excluded_s", 0.0)
    if stats.get("wire_bytes"):  # what an engine sent back per token (its cost of the final state shows here)
        stats["wire_bytes_per_token"] = stats["wire_bytes"] / max(1, todo_tokens)
    return seconds, stats
