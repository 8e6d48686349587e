"""The benchmark scripts run (a CPU dry run of the GPU sweep), so they do not rot between GPU sessions."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_train_throughput_dry_run_prints_figures():
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/train_throughput.py",
            "--small",
            "--device",
            "cpu",
            "--seqs",
            "128,200",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--freeze-lm-head",
            "--profile",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["seq"] for r in summary["results"]] == [128, 200]
    for r in summary["results"]:
        assert r["tokens_per_s"] > 0 and r["freeze_lm_head"] and r["loss"] > 0
    # --profile: one step's time by kind at the first length; its matmuls are found and counted
    profile = json.loads(next(line for line in out.stdout.splitlines() if line.startswith('{"profile"')))["profile"]
    assert profile["by_kind_ms"]["gemm"] > 0 and profile["kernel_ms"] >= profile["by_kind_ms"]["gemm"]
    assert any(name == "aten::mm" for name, ms, calls in profile["top"])


def test_train_throughput_measures_kimis_mla_draft_layer():
    """--shape kimi-mla: the MLA draft layer's training step (issue 41's throughput on the H200), dry run on the CPU
    at the small shape; speculators has no MLA step to compare with, and says so."""
    cmd = [sys.executable, "benchmarks/train_throughput.py", "--small", "--device", "cpu", "--seqs", "96"]
    cmd += ["--steps", "1", "--warmup", "1", "--shape", "kimi-mla"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["config"] == "small kimi-k2.5 mla" and summary["results"][0]["tokens_per_s"] > 0
    refused = subprocess.run(cmd + ["--impl", "both"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "on --shape llama-8b only" in refused.stderr


def test_train_levers_dry_run_prints_figures():
    out = subprocess.run(
        [sys.executable, "benchmarks/train_levers.py", "--small", "--device", "cpu", "--seq", "128", "--iters", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(r["per_layer"]) >= {"q_proj", "down_proj", "lm_head (frozen)", "fc (once)"}
    assert r["gemm_bf16_ms"] > 0 and r["gemm_fp8_ms"] > 0 and r["quantize_fp8_ms"] > 0
    assert all(v["fp8_rel_err"] < 0.1 for v in r["per_layer"].values())  # the fp8 products are the same products


def test_batch_throughput_compares_bf16_and_fp8_shards():
    args = ["--tokens", "20000", "--hidden", "64", "--shard-tokens", "6000", "--max-seq-len", "512", "--epochs", "1"]
    out = subprocess.run(
        [sys.executable, "benchmarks/batch_throughput.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    heads = {r["store_dtype"]: r for r in rows if "tokens_per_epoch" in r}
    assert heads["bfloat16"]["tokens_per_epoch"] == heads["float8_e4m3fn"]["tokens_per_epoch"]  # the same lengths
    assert heads["float8_e4m3fn"]["bytes_per_token"] < 4 * 64 + 21 + 200 < heads["bfloat16"]["bytes_per_token"]
    measured = [r for r in rows if "batch_prefetch" in r]
    assert len(measured) == 4 and all(r["tokens_per_s"] > 0 and r["vs_first_dtype"] > 0 for r in measured)
    assert all(r["dequant_ms_per_1k_tokens"] > 0 for r in measured if r["store_dtype"] == "float8_e4m3fn")


def test_train_throughput_packs_the_rows_of_a_token_file(tmp_path):
    """--docs: rows packed as the trainer packs them from a prepare-stage token file (whole sequences, padding at
    the end), reported with what they hold; the merged attention runs on them (its CPU reference here)."""
    import torch

    from eagle3lib.prepare.conversations import save_tokens

    lengths = [70, 40, 120, 30, 90, 60, 50, 110] * 3
    starts = torch.tensor([0] + lengths).cumsum(0)
    mask = torch.zeros(int(starts[-1]), dtype=torch.uint8)
    for a, n in zip(starts[:-1].tolist(), lengths):
        mask[a + n // 3 : a + n] = 1  # the first third of each sequence is its prompt
    path = save_tokens(
        tmp_path / "tokens.safetensors",
        {
            "input_ids": torch.arange(len(mask), dtype=torch.int32) % 5000,
            "loss_mask": mask,
            "seq_starts": starts,
            "ids": [str(i) for i in range(len(lengths))],
        },
    )
    args = ["--small", "--device", "cpu", "--seqs", "256", "--steps", "2", "--warmup", "1", "--docs", str(path)]
    out = subprocess.run(
        [sys.executable, "benchmarks/train_throughput.py", *args, "--attention", "merged"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (r,) = json.loads(out.stdout.strip().splitlines()[-1])["results"]
    assert r["rows"] == "packed" and r["attention"] == "merged" and r["loss_rows"] == "valid"
    assert 2 <= r["docs_per_row"] <= 5 and 150 < r["real_tokens_per_row"] <= 256
    assert 0.6 < r["loss_mask_share"] < 0.7 and r["tokens_per_s"] > 0 and r["loss"] > 0


def test_link_throughput_carries_the_states_intact():
    """The process placement's link alone, between two processes (gloo on the CPU): the figures, and what arrived
    is what was sent."""
    cmd = [sys.executable, "benchmarks/link_throughput.py", "--hidden", "64", "--seq", "256", "--batches", "6"]
    out = subprocess.run(cmd + ["--rows", "2", "--queue", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["intact"] and r["backend"] == "gloo" and r["batches_timed"] == 4 and r["tokens_per_batch"] == 512
    assert r["state_bytes_per_token"] == 4 * 64 * 2 and r["tokens_per_s"] > 0 and r["state_gb_per_s"] > 0
    refused = subprocess.run(cmd[:-1] + ["2"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "leaves nothing timed" in refused.stderr
