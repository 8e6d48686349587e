"""Extraction (capture) against the target's plain prefill: tokens/s of each, hf on the CPU, SGLang on a GPU.

Prints tokens/s of the plain forward, the capture and extract(); on a GPU host `python -m benchmarks capture
gpu-plan [check|long|levers|tp]` runs capture.sh (SGLang's in-process capture and server backend against hf).

Extraction throughput vs the target's plain forward, on a random Llama (no downloads).

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks capture --shape tiny
    OMP_WAIT_POLICY=PASSIVE python -m benchmarks capture --shape smollm2 --tokens 8192

Prints tokens/s of: the plain forward (model.model, no hooks), capture_hidden_states alone,
and extract() (forward + capture + bf16 shard writes, one run), on the same batches.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
import transformers  # noqa: E402

from benchmarks import gpu_script  # noqa: E402
from eagle3lib.extract.hf import capture_hidden_states, extract, iter_batches, measure_forward_tokens_per_s
from eagle3lib.extract.shards import default_shard_max_tokens

SHAPES = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
    ),
    "smollm2": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),  # SmolLM2-135M's shape
}


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu-plan"]:
        return gpu_script.plan_main("capture", argv[1:], PLANS, "check")
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--shard-max-tokens", type=int, help="default: what extract() picks (about 1 GiB a shard)")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**SHAPES[args.shape])
    model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, args.dtype)).eval()
    L = cfg.num_hidden_layers
    aux_ids = [2, L // 2, L - 3]
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(16, 512, (args.tokens // 256,), generator=g)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    tokens = {
        "input_ids": torch.randint(0, cfg.vocab_size, (int(starts[-1]),), generator=g, dtype=torch.int32),
        "loss_mask": torch.ones(int(starts[-1]), dtype=torch.uint8),
        "seq_starts": starts,
    }
    n = int(starts[-1])
    shard_max_tokens = args.shard_max_tokens or default_shard_max_tokens(cfg.hidden_size, torch.bfloat16)
    batches = list(iter_batches(tokens, args.batch_tokens, shard_max_tokens))
    padded = sum(ids.numel() for _, ids, _ in batches)
    print(
        f"{args.shape} ({args.dtype}), {len(lengths)} sequences, {n:,} tokens, {len(batches)} batches, "
        f"padding {padded / n - 1:.1%}, torch threads {torch.get_num_threads()}"
    )

    def capture_tokens_per_s():
        t0 = time.perf_counter()
        for _, ids, mask in batches:
            capture_hidden_states(model, ids, mask, aux_ids)
        return n / (time.perf_counter() - t0)

    # alternate rounds and keep each one's best: this machine is shared and warms up
    capture_hidden_states(model, batches[0][1], batches[0][2], aux_ids)
    fwd, cap = 0.0, 0.0
    for _ in range(args.rounds):
        fwd = max(fwd, measure_forward_tokens_per_s(model, batches, warmup=0))
        cap = max(cap, capture_tokens_per_s())
    with tempfile.TemporaryDirectory() as d:
        r = extract(
            model,
            tokens,
            aux_ids,
            d,
            {"target": f"random-{args.shape}"},
            batch_tokens=args.batch_tokens,
            shard_max_tokens=shard_max_tokens,
            progress=False,
        )
    print(f"forward only   {fwd:10,.0f} tokens/s")
    print(f"capture        {cap:10,.0f} tokens/s  ({cap / fwd:.2f}x forward)")
    print(
        f"extract        {r['tokens_per_s']:10,.0f} tokens/s  ({r['tokens_per_s'] / fwd:.2f}x forward; "
        f"{r['bytes_per_token']:,.0f} bytes/token on disk, {r['shards']} shards; capture {r['capture_s']} s, "
        f"of which waiting for the shard writer {r['write_wait_s']} s, in {r['seconds']:.2f} s)"
    )
    row = {"shape": args.shape, "forward_tokens_per_s": round(fwd), "capture_tokens_per_s": round(cap)}
    print(json.dumps(row | {"extract_tokens_per_s": round(r["tokens_per_s"]), "bytes_per_token": r["bytes_per_token"]}))


PLANS = {mode: ([], {"MODE": mode}) for mode in ("check", "long", "levers", "tp", "server")}


def headline(rows: list[dict]) -> dict:
    r = rows[-1]
    return {k: r[k] for k in ("forward_tokens_per_s", "capture_tokens_per_s", "extract_tokens_per_s") if k in r}


def dry_run(work: Path) -> list[str]:
    return ["--shape", "tiny", "--tokens", "2048", "--batch-tokens", "512", "--rounds", "1"]


if __name__ == "__main__":
    sys.exit(main())
