"""The per set prediction (speedup/predict.py) on a GPU against the target's dtype and the drafter's attention path:
the same held-out prompts and the target's own greedy replies; every variant's estimated AL@5 near the fp32 dense
one's. RUN_DIR: a finished run with 00_prepare and 02_train, named by E3_RUN_DIR (skipped without it).

    E3_RUN_DIR=outputs/tiny .venv/bin/python -m pytest tests/gpu/test_predict_devices.py
"""

import functools
import os
from pathlib import Path

import pytest

from eagle3lib import target
from eagle3lib.prepare import conversations
from eagle3lib.speedup import predict, prompt_sets, replay
from eagle3lib.train import ttt_step
from eagle3lib.train.runtime import checkpoint

pytestmark = pytest.mark.gpu
TOLERANCE = 0.1  # AL@5: bf16 and the fused attention paths round differently, the prediction stays the same


def variants(run: Path, device: str = "cuda") -> dict[str, float]:
    cache = target.default_cache_dir()
    tdir = target.embedded_target_dir(cache)
    render = prompt_sets.renderer(target.load_tokenizer(str(tdir)))
    held = conversations.load_bench_prompts(run / "00_prepare" / "bench.jsonl")[:6]
    results = {}
    for dtype in ("bfloat16", "float32"):
        model, _ = target.load_target(str(tdir), cache, dtype=dtype, device=device)
        seqs = [
            {"id": b["id"], "set": "held_out", "prompt_ids": ids, "token_ids": replay.greedy_decode(model, ids, 96)}
            for b in held
            for ids in [render(b["messages"])]
        ]
        for drafter_dtype in ("float32", "bfloat16"):
            drafter = checkpoint.load_drafter(run / "02_train" / "drafter", device=device)
            drafter = drafter.to(target.torch_dtype(drafter_dtype))
            for attention in ("dense", "flex", "merged", "auto"):
                predict.ttt_loss_sums = functools.partial(ttt_step.ttt_loss_sums, attention=attention)
                out = predict.predict_per_set(
                    model, drafter.eval(), seqs, drafter.cfg.aux_layer_ids, 5, steps=3, device=device
                )
                results[f"target {dtype}, drafter {drafter_dtype}, attention {attention}"] = out["all"][
                    "accept_len_at"
                ][5]
    return results


def test_the_prediction_agrees_across_dtypes_and_attention_paths():
    run = os.environ.get("E3_RUN_DIR")
    if not run:
        pytest.skip("E3_RUN_DIR names no finished run (00_prepare and 02_train)")
    found = variants(Path(run))
    reference = found["target float32, drafter float32, attention dense"]
    far = {k: v for k, v in found.items() if abs(v - reference) > TOLERANCE}
    assert not far, f"AL@5 far from fp32 dense's {reference:.3f}: {far}"
