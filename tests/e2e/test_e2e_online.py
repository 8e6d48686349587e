"""End-to-end in online mode: tests/params/ci-online.yaml (ci.yaml with train.source: online, a capture process and a
trainer over gloo) through prepare, extract and train with the real SmolLM2 and ShareGPT."""

import json
from pathlib import Path

import pytest

from eagle3lib.train.sources.base import CAPTURE_SUMMARY
from eagle3lib.workbook import pipeline

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_online_run_trains_with_no_hidden_states_on_disk(tmp_path, embedded_cache):
    overrides = {"run.output_root": str(tmp_path), "run.cache_dir": str(embedded_cache[0])}
    run_dir = pipeline.run_pipeline(
        ROOT / "tests" / "params" / "ci-online.yaml", overrides, to_stage="train", log_output=False
    )
    result = {s: json.loads((run_dir / s / "result.json").read_text()) for s in ("01_extract", "02_train")}
    assert all(r["status"] == "ok" for r in result.values())
    assert result["01_extract"]["figures"]["splits"] == {} and result["01_extract"]["figures"]["bytes"] == 0
    train = result["02_train"]["figures"]
    assert train["eval"]["loss_per_step"][0] < 0.9 * train["initial_eval"]["loss_per_step"][0]
    assert train["world_size"] == 1 and train["steps"] == train["total_steps"] == 16  # 4,096 tokens of 256-token rows
    capture = json.loads((run_dir / "02_train" / CAPTURE_SUMMARY).read_text())
    assert capture["tokens"] >= train["tokens"] and capture["capture_tokens_per_s"] > 0
    # 0 bytes of hidden states: the safetensors files are the token files, the checkpoints and the drafter
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    tensors = {str(p.relative_to(run_dir)).split("/")[1] for p in files if p.suffix == ".safetensors"}
    assert tensors == {"train.safetensors", "val.safetensors", "checkpoints", "drafter"}, tensors
    # beside the checkpoints and the drafter (weights and optimizer state), the run folder holds the token files, the
    # logs, notebooks and reports: a small part of what the states' shards would take (4 states of 576 in bf16)
    tokens = sum(figures["tokens"] for figures in prepared_tokens(run_dir).values())
    states_bytes = tokens * 4 * 576 * 2
    weights = ("02_train/checkpoints", "02_train/drafter")
    other = sum(p.stat().st_size for p in files if not str(p.relative_to(run_dir)).startswith(weights))
    assert other < 0.2 * states_bytes, (other, states_bytes)


def prepared_tokens(run_dir: Path) -> dict:
    figures = json.loads((run_dir / "00_prepare" / "result.json").read_text())["figures"]
    return {split: figures["tokens"][split] for split in ("train", "val")}
