"""The benchmark questions run: each one's dry run (a CPU-sized version, stand-ins where a GPU or an engine is
needed) writes its result folder, so that no question rots between GPU runs; `list` names every question."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import runner

ROOT = Path(__file__).resolve().parents[2]
RESULT_KEYS = {"question", "hardware", "date", "command", "machine", "versions", "headline", "rows"}


def bench(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def rows(out: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("question", runner.names())
def test_each_question_dry_runs_into_its_result_folder(question, tmp_path):
    out = bench(question, "--dry-run", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (folder,) = (tmp_path / question).iterdir()
    result = json.loads((folder / "result.json").read_text())
    assert RESULT_KEYS <= set(result) and result["question"] == question and result["dry_run"]
    assert folder.name == f"{result['hardware']}-{result['date']}" and result["rows"]
    assert result["command"].startswith(f"python -m benchmarks {question} --dry-run")
    assert "```" in (folder / "README.md").read_text()


def test_list_names_every_question_module():
    out = bench("list", timeout=60)
    assert out.returncode == 0, out.stderr
    listed = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    modules = sorted(p.stem for p in (ROOT / "benchmarks" / "questions").glob("*.py") if p.stem != "__init__")
    assert listed == modules
    assert all(len(line.split(None, 1)) == 2 for line in out.stdout.splitlines())  # each with its first line


def test_an_unknown_question_is_refused():
    out = bench("no_such_question", timeout=60)
    assert out.returncode == 2 and "python -m benchmarks list" in out.stderr


def test_train_step_measures_kimis_mla_draft_layer_and_refuses_speculators_there(tmp_path):
    """--shape kimi-mla at the small shape on the CPU; speculators has no MLA step to compare with, and says so."""
    args = ["train_step", "--dry-run", "--out", str(tmp_path), "--seqs", "96", "--shape", "kimi-mla"]
    out = bench(*args)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = rows(out)[-1]
    assert summary["config"] == "small kimi-k2.5 mla" and summary["results"][0]["tokens_per_s"] > 0
    refused = bench(*args, "--impl", "both", timeout=120)
    assert refused.returncode == 2 and "on --shape llama-8b only" in refused.stderr


def test_train_step_packs_the_rows_of_a_token_file(tmp_path):
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
    args = ["--seqs", "256", "--steps", "2", "--docs", str(path), "--attention", "merged", "--profile"]
    out = bench("train_step", "--dry-run", "--out", str(tmp_path / "out"), *args)
    assert out.returncode == 0, out.stderr[-2000:]
    (r,) = rows(out)[-1]["results"]
    assert r["rows"] == "packed" and r["attention"] == "merged" and r["loss_rows"] == "valid"
    assert 2 <= r["docs_per_row"] <= 5 and 150 < r["real_tokens_per_row"] <= 256
    assert 0.6 < r["loss_mask_share"] < 0.7 and r["tokens_per_s"] > 0 and r["loss"] > 0
    profile = next(row["profile"] for row in rows(out) if "profile" in row)  # one step's time by kind
    assert profile["by_kind_ms"]["gemm"] > 0 and profile["kernel_ms"] >= profile["by_kind_ms"]["gemm"]


def test_link_refuses_a_run_with_nothing_timed(tmp_path):
    out = bench("link", "--dry-run", "--out", str(tmp_path), "--batches", "2", timeout=60)
    assert out.returncode != 0 and "leaves nothing timed" in out.stderr
