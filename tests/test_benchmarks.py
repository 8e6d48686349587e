"""The benchmark scripts run (a CPU dry run of the GPU sweep), so they do not rot between GPU sessions."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_train_throughput_dry_run_prints_figures():
    out = subprocess.run([sys.executable, "benchmarks/train_throughput.py", "--small", "--device", "cpu",
                          "--seqs", "128,200", "--steps", "1", "--warmup", "1", "--freeze-lm-head"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["seq"] for r in summary["results"]] == [128, 200]
    for r in summary["results"]:
        assert r["tokens_per_s"] > 0 and r["freeze_lm_head"] and r["loss"] > 0
