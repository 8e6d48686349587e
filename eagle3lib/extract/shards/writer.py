"""The one writer every backend goes through: extract_with captures the states of every sequence through a
backend (a Capture: hf.HFCapture, vllm.VLLMCapture, sglang.SGLangCapture, sglang_inprocess) and writes them as
shards, resuming where an earlier call stopped.

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
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch
from tqdm.auto import tqdm

from eagle3lib.extract.shards.dtypes import capture_dtype, store_states
from eagle3lib.extract.shards.files import write_json
from eagle3lib.extract.shards.format import bytes_per_token, default_shard_max_tokens, write_shard
from eagle3lib.extract.shards.manifest import (
    MANIFEST,
    begin_manifest,
    check_contract_file,
    list_shard,
    load_manifest,
    missing_ranges,
    verify_and_repair,
)
from eagle3lib.extract.shards.plan import plan_shards
from eagle3lib.extract.shards.tokens import as_token_tensors


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


def shard_tensors(tok, first, end, stored: dict):
    """The tensors of the shard holding sequences [first, end), given their states in token order (store_states)."""
    starts = tok["seq_starts"]
    base, n = int(starts[first]), int(starts[end] - starts[first])
    rows = {k: v.shape[0] for k, v in stored.items()}
    if any(r != n for r in rows.values()):
        raise ValueError(
            f"sequences {first}..{end - 1} have {n} tokens, the backend returned rows {rows}; expected one row per token"
        )
    return {
        "input_ids": tok["input_ids"][base : base + n].clone(),
        "loss_mask": tok["loss_mask"][base : base + n].clone(),
        **{k: v.cpu() for k, v in stored.items()},
        "seq_starts": starts[first : end + 1] - base,
    }


def extract_with(
    capture: Capture,
    tokens,
    aux_layer_ids,
    out_dir,
    contract,
    batch_tokens=4096,
    shard_max_tokens=None,
    store_dtype=torch.bfloat16,
    progress=True,
    free_bytes=None,
    verify_existing=True,
    writers=2,
):
    """Capture aux + final hidden states for every sequence through `capture` (a backend, see Capture)
    and write them as shards.

    Resumes where an earlier call stopped (killed or not): shards the manifest lists and that
    verify are kept, bad or unlisted ones are redone. A complete extraction is not redone.
    shard_max_tokens=None means about 1 GiB per shard. free_bytes overrides the free disk space
    (for tests). verify_existing=False checks existing shards by size instead of sha256.
    batch_tokens is recorded in the manifest (and used by the hf backend). writers: shards written (bytes,
    sha256, fsync) at once in threads while the next one is captured.

    Returns {backend, sequences, tokens (done in this call), total_sequences, total_tokens, shards,
    bytes (all shards on disk), bytes_per_token, seconds, tokens_per_s (this call's capture+write,
    engine start-up excluded), complete, capture_s, write_wait_s (capture waiting for the writer)} plus the
    backend's stats() (engine start, plain prefill...).
    """
    tok = as_token_tensors(tokens)
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
    shard_max_tokens = shard_max_tokens or default_shard_max_tokens(hidden_size, store_dtype, len(aux_layer_ids))
    os.makedirs(out_dir, exist_ok=True)
    check_contract_file(out_dir, contract)
    begin_manifest(out_dir, tok, aux_layer_ids, hidden_size, store_dtype, shard_max_tokens, batch_tokens)
    for name, why in verify_and_repair(out_dir, check_sha256=verify_existing):
        print(f"extract: dropped {name}, will redo its sequences: {why}")
    manifest = load_manifest(out_dir)

    starts = tok["seq_starts"]
    lengths = (starts[1:] - starts[:-1]).tolist()
    plan = [r for a, b in missing_ranges(manifest) for r in plan_shards(lengths, a, b, shard_max_tokens)]
    todo_tokens = sum(int(starts[b] - starts[a]) for a, b in plan)
    if plan:
        need = todo_tokens * bytes_per_token(hidden_size, store_dtype, len(aux_layer_ids)) + 4096 * len(plan) + 2**16
        free = shutil.disk_usage(out_dir).free if free_bytes is None else free_bytes
        print(
            f"extract ({capture.name}): {sum(b - a for a, b in plan):,} sequences, {todo_tokens:,} tokens to do in "
            f"{len(plan)} shards; needs ~{need / 1e9:.3f} GB ({need:,} bytes), {free:,} bytes free in {out_dir}"
        )
        if free < need:
            raise OSError(
                f"not enough disk space in {out_dir}: the remaining shards need ~{need:,} bytes, "
                f"{free:,} bytes are free; free space, pick another out_dir, or extract fewer tokens"
            )

    seconds, stats = 0.0, {}
    if plan:
        t0 = time.perf_counter()
        waits = {"capture_s": 0.0, "write_wait_s": 0.0}

        def listed(pending):  # a shard enters the manifest only once its file is complete on disk
            t = time.perf_counter()
            entry = pending.result()
            waits["write_wait_s"] += time.perf_counter() - t
            list_shard(out_dir, manifest, entry)

        # Shards are written (bytes, sha256, fsync: ~3 s a GB) in threads while the next one is captured;
        # on an H200 the synchronous write held the hf backend to 0.11 of the target's forward.
        with (
            tqdm(total=todo_tokens, unit="tok", unit_scale=True, disable=not progress, desc="extract") as bar,
            capture.session(tok, lengths, plan, out_dir),
            ThreadPoolExecutor(max(1, writers)) as writer,
        ):
            pending = deque()
            for first, end in plan:
                t = time.perf_counter()
                got = capture.shard(tok, lengths, first, end, capture_dtype(store_dtype), bar)
                stored = got if isinstance(got, dict) else store_states(*got, len(aux_layer_ids), store_dtype)
                tensors = shard_tensors(tok, first, end, stored)
                waits["capture_s"] += time.perf_counter() - t
                while len(pending) >= max(1, writers):
                    listed(pending.popleft())
                # backends return new tensors per shard, so the next capture cannot overwrite these
                pending.append(writer.submit(write_shard, out_dir, tensors, first, aux_layer_ids))
            while pending:
                listed(pending.popleft())
        stats = {**capture.stats(), **{k: round(v, 2) for k, v in waits.items()}}
        # Engine start-up (loading the target, spawning workers) is reported apart, not as capture time.
        seconds = time.perf_counter() - t0 - stats.get("excluded_s", 0.0)
        if stats.get("wire_bytes"):  # what an engine sent back per token (its cost of the final state shows here)
            stats["wire_bytes_per_token"] = stats["wire_bytes"] / max(1, todo_tokens)
    if not manifest["complete"]:
        manifest["complete"] = True
        write_json(os.path.join(out_dir, MANIFEST), manifest)
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
