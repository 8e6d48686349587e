"""The trainer's input pipeline: tokens/s of micro-batches made from bf16 and fp8 shards, no model.

Prints one JSON line per store dtype and per prefetch setting.

How fast the trainer's input pipeline turns extracted shards into micro-batches, without a model.

    python -m benchmarks batches                       # SmolLM2-135M's widths, as params/smollm2-135m-gpu.yaml trains
    python -m benchmarks batches --hidden 4096 --tokens 400000 --max-seq-len 8192 --batch-rows 1

Writes synthetic shards (random lengths; the states in each --store-dtypes, from the same values) to a temp
folder, then times train.micro_batches over them: tokens/s and bytes/s of finished micro-batches, for the batches made
in the training thread (--batch-prefetch 0) and in a background thread (train.batch_prefetch), each
with shard prefetching as train.prefetch_shards sets it. --step-ms stands in for a GPU training step
(the host thread sleeps, as it waits on the GPU): then data_wait_s is the time the step loop waited for
batches, as the trainer's summary reports it (an H200 ran SmolLM2's drafter at ~0.1 s a step).
fp8 batches stay e4m3 up to the training device, which dequantizes them (train.batches.batch_states);
dequant_ms_per_1k_tokens is that step's cost on this CPU, for a CPU-only run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import eagle3lib  # noqa: F401  (OMP_WAIT_POLICY before torch)
from eagle3lib.extract.shards import FORMAT, MANIFEST, ShardSet, store_states, write_shard
from eagle3lib.target import torch_dtype
from eagle3lib.train.runtime.batches import batch_states, micro_batches, shard_sequences


def write_synthetic_shards(
    out_dir: str, tokens: int, hidden: int, shard_tokens: int, store_dtype=torch.bfloat16, seed: int = 0
) -> int:
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(64, 2048, (1,), generator=g)))
    entries, first, at = [], 0, 0
    while first < len(lengths):
        end, n = first, 0
        while end < len(lengths) and (n == 0 or n + lengths[end] <= shard_tokens):
            n += lengths[end]
            end += 1
        starts = torch.tensor([0] + lengths[first:end]).cumsum(0)
        tensors = {
            "input_ids": torch.randint(0, 49152, (n,), dtype=torch.int32, generator=g),
            "loss_mask": torch.ones(n, dtype=torch.uint8),
            **store_states(
                torch.randn(n, 3 * hidden, generator=g), torch.randn(n, hidden, generator=g), 3, store_dtype
            ),
            "seq_starts": starts,
        }
        entries.append(write_shard(out_dir, tensors, first, [1, 2, 3]))
        first, at = end, at + n
    manifest = {
        "format": FORMAT,
        "num_sequences": len(lengths),
        "num_tokens": at,
        "hidden_size": hidden,
        "aux_layer_ids": [1, 2, 3],
        "store_dtype": str(store_dtype).removeprefix("torch."),
        "complete": True,
        "shards": entries,
    }
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f)
    return at


def measure(
    shard_dir: str,
    max_seq_len: int,
    batch_rows: int,
    prefetch_shards: int,
    batch_prefetch: int,
    epochs: int,
    step_ms: float = 0.0,
) -> dict:
    shards = ShardSet(shard_dir)  # a fresh one per measurement: as a training run, it checks each sha256 once
    train_params = SimpleNamespace(max_seq_len=max_seq_len, batch_rows=batch_rows, batch_prefetch=batch_prefetch)
    stream = micro_batches(
        lambda epoch, start: shard_sequences(shards, 0, epoch, start, prefetch=prefetch_shards), train_params, 0, 0
    )
    tokens = nbytes = 0
    wait = dequant = 0.0
    start = time.perf_counter()
    try:
        while True:
            waited = time.perf_counter()
            epoch, _, mb = next(stream)
            wait += time.perf_counter() - waited
            if epoch >= epochs:
                break
            tokens += mb["tokens"]
            nbytes += sum(v.numel() * v.element_size() for v in mb.values() if torch.is_tensor(v))
            if "aux_scale" in mb and dequant == 0.0:  # once: the trainer does this on its device
                t = time.perf_counter()
                batch_states(mb, torch.bfloat16)
                dequant = (time.perf_counter() - t) / mb["input_ids"].numel() * 1e6
            time.sleep(step_ms / 1e3)
    finally:
        stream.close()
    s = time.perf_counter() - start
    return {
        "prefetch_shards": prefetch_shards,
        "batch_prefetch": batch_prefetch,
        "step_ms": step_ms,
        "tokens": tokens,
        "seconds": round(s, 2),
        "tokens_per_s": round(tokens / s),
        "batch_MB_per_s": round(nbytes / s / 1e6),
        "data_wait_s": round(wait, 2),
        "dequant_ms_per_1k_tokens": round(dequant, 3) if dequant else None,
    }


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=576, help="target hidden size (SmolLM2-135M: 576)")
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument(
        "--shard-tokens", type=int, default=262_144, help="as params/smollm2-135m-gpu.yaml's extract.shard_max_tokens"
    )
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--batch-rows", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--prefetch-shards", type=int, default=2)
    ap.add_argument("--step-ms", type=float, default=0.0, help="a stand-in training step per micro-batch (sleep)")
    ap.add_argument("--store-dtypes", nargs="+", default=["bfloat16", "float8_e4m3fn"], help="compared in this run")
    args = ap.parse_args(argv)
    first = {}
    for name in args.store_dtypes:
        for r in run(args, torch_dtype(name)):
            key = r.get("batch_prefetch")
            if key is not None:
                first.setdefault(key, r["tokens_per_s"])
                r["vs_first_dtype"] = round(r["tokens_per_s"] / first[key], 3)
            print(json.dumps(r), flush=True)


def run(args, store_dtype):
    """The header line, then one measurement per batch_prefetch, of shards in store_dtype."""
    with tempfile.TemporaryDirectory() as d:
        total = write_synthetic_shards(d, args.tokens, args.hidden, args.shard_tokens, store_dtype)
        shards = ShardSet(d)
        yield {
            "store_dtype": str(store_dtype).removeprefix("torch."),
            "tokens_per_epoch": total,
            "shards": len(shards.shards),
            "bytes_per_token": round(sum(e["bytes"] for e in shards.shards) / total, 1),
            "hidden": args.hidden,
            "max_seq_len": args.max_seq_len,
            "batch_rows": args.batch_rows,
        }
        for batch_prefetch in (0, 2):
            yield {"store_dtype": str(store_dtype).removeprefix("torch.")} | measure(
                d, args.max_seq_len, args.batch_rows, args.prefetch_shards, batch_prefetch, args.epochs, args.step_ms
            )


def dry_run(work: Path) -> list[str]:
    return ["--tokens", "20000", "--hidden", "64", "--shard-tokens", "6000", "--max-seq-len", "512", "--epochs", "1"]


def headline(rows: list[dict]) -> dict:
    measured = [r for r in rows if "batch_prefetch" in r]
    return {f"tokens_per_s {r['store_dtype']} prefetch {r['batch_prefetch']}": r["tokens_per_s"] for r in measured}


if __name__ == "__main__":
    sys.exit(main())
