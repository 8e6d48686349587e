"""The per set prediction (bench/predict.py) on one device against the target's dtype and the drafter's attention
path: the same held-out prompts and the target's own greedy replies, each variant's cond_acc and estimated AL.
    python benchmarks/h200/predict_check.py RUN_DIR cuda|cpu   (RUN_DIR: a run with 00_prepare and 02_train)"""

import functools
import json
import sys
from pathlib import Path

from eagle3lib import target
from eagle3lib.bench import predict, prompt_sets, replay
from eagle3lib.prepare import conversations
from eagle3lib.train import checkpoint, ttt_step

run, device = Path(sys.argv[1]), sys.argv[2]
cache = target.default_cache_dir()
tdir = target.embedded_target_dir(cache)
render = prompt_sets.renderer(target.load_tokenizer(str(tdir)))
held = conversations.load_bench_prompts(run / "00_prepare" / "bench.jsonl")[:6]
results = {}
for dtype in ("bfloat16", "float32") if device == "cuda" else ("float32",):
    model, _ = target.load_target(str(tdir), cache, dtype=dtype, device=device)
    seqs = []
    for b in held:
        ids = render(b["messages"])
        seqs.append(
            {"id": b["id"], "set": "held_out", "prompt_ids": ids, "token_ids": replay.greedy_decode(model, ids, 96)}
        )
    for drafter_dtype in ("float32", "bfloat16") if device == "cuda" else ("float32",):
        drafter = checkpoint.load_drafter(run / "02_train" / "drafter", device=device).to(
            target.torch_dtype(drafter_dtype)
        )
        for attention in ("dense", "flex", "merged", "auto") if device == "cuda" else ("dense",):
            predict.ttt_loss_sums = functools.partial(ttt_step.ttt_loss_sums, attention=attention)
            out = predict.predict_per_set(
                model, drafter.eval(), seqs, drafter.cfg.aux_layer_ids, 5, steps=3, device=device
            )
            key = f"target {dtype}, drafter {drafter_dtype}, attention {attention}"
            results[key] = {
                "cond_acc": [round(x, 3) for x in out["all"]["cond_acc"]],
                "AL@5": round(out["all"]["accept_len_at"][5], 3),
            }
            print(key, results[key], flush=True)
print(json.dumps(results))
