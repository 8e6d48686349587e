"""End-to-end: the stage notebooks under papermill on tests/params/ci.yaml with the real SmolLM2 and ShareGPT."""

import json
import os
import shutil
from pathlib import Path

import pytest

from eagle3lib import engines
from eagle3lib.convert import notebook as convert_notebook
from eagle3lib.extract import shards
from eagle3lib.speedup import replay
from eagle3lib.workbook import pipeline

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


# ci_run: the session's pipeline run on tests/params/ci.yaml (conftest.py), shared with test_browser.py and test_lab.py


def result(run_dir, stage):
    return json.loads((run_dir / stage / "result.json").read_text())


def test_every_stage_ran_and_reported(ci_run):
    run_dir, _ = ci_run
    for stage in pipeline.stages():
        r = result(run_dir, stage)
        assert r["status"] == "ok", (stage, r.get("error"))
        assert (run_dir / stage / f"{stage}.html").is_file()
    run = json.loads((run_dir / "run.json").read_text())
    assert run["params"]["run"]["name"] == "ci" and run["versions"]["torch"].startswith("2.")
    index = (run_dir / "index.html").read_text()
    assert all(f"{s}/{s}.html" in index for s in pipeline.stages())


def test_prepare_used_the_embedded_data_and_target(ci_run):
    r = result(ci_run[0], "00_prepare")["figures"]
    assert r["read"]["kept"] == 40 and r["splits"]["bench"] == 4
    assert r["tokens"]["train"]["loss_tokens"] > 0 and r["target"]["aux_layer_ids"] == [2, 15, 27]
    assert r["regenerate"]["tokens_generated"] > 0
    sizing = r["regenerate"]["sizing"]  # data.regenerate.max_minutes, measured on its first batch
    assert sizing["sized_tokens"] == 256 and sizing["text"].startswith("regeneration not cut: all 256 tokens fit")


def test_extract_wrote_checksummed_shards(ci_run):
    run_dir, _ = ci_run
    r = result(run_dir, "01_extract")["figures"]
    for key in ("sequences", "tokens", "bytes_per_token", "tokens_per_s", "forward_tokens_per_s"):
        assert r[key] and r[key] > 0, key
    # bf16: input id (4) + mask (1) + 3 aux + 1 final states of 576 (2 bytes each), plus headers.
    assert 4 + 1 + 4 * 576 * 2 <= r["bytes_per_token"] < 4 + 1 + 4 * 576 * 2 + 64
    shard_set = shards.ShardSet(run_dir / "01_extract" / "train")
    assert (
        shard_set.contract["aux_layer_ids"] == [2, 15, 27]
        and shard_set.num_tokens == r["splits"]["train"]["total_tokens"]
    )
    sized = r["sizing"]  # extract.max_minutes: val timed first, every train sequence fits
    assert sized["sequences"] == sized["total_sequences"] == r["splits"]["train"]["total_sequences"]
    assert sized["text"].startswith("train split not cut") and (run_dir / "01_extract" / "sizing.json").is_file()


def test_training_beats_the_untrained_drafter(ci_run):
    r = result(ci_run[0], "02_train")["figures"]
    before, after = r["initial_eval"], r["eval"]
    assert after["loss_per_step"][0] < 0.85 * before["loss_per_step"][0]
    assert after["step_acc"][0] > before["step_acc"][0] + 0.03
    assert float(after["est_accept_len"]["5"]) > float(before["est_accept_len"]["5"])


def test_rerun_skips_and_a_deleted_shard_is_redone(ci_run, capsys):
    run_dir, overrides = ci_run
    capsys.readouterr()
    pipeline.run_pipeline(ROOT / "tests" / "params" / "ci.yaml", overrides, log_output=False)
    assert capsys.readouterr().err.count("unchanged, skipped") == len(pipeline.stages())
    manifest = json.loads((run_dir / "01_extract" / "train" / "manifest.json").read_text())
    victim = run_dir / "01_extract" / "train" / manifest["shards"][0]["file"]
    others = {e["file"]: (victim.parent / e["file"]).stat().st_mtime_ns for e in manifest["shards"][1:]}
    victim.write_bytes(victim.read_bytes()[:1000])  # truncated
    pipeline.run_pipeline(ROOT / "tests" / "params" / "ci.yaml", overrides, log_output=False)  # a plain run
    err = capsys.readouterr().err
    assert f"01_extract: 1 of its files changed since it made them (train/{victim.name}: 1000 bytes" in err, err
    assert err.count("unchanged, skipped") == len(pipeline.stages()) - 1  # the same inputs: nothing later reruns
    assert shards.ShardSet(run_dir / "01_extract" / "train").verify_all() == manifest["num_sequences"]
    assert {f: (victim.parent / f).stat().st_mtime_ns for f in others} == others  # the damaged shard alone redone
    assert (
        f"extract: dropped {victim.name}, will redo its sequences"
        in (run_dir / "01_extract" / "01_extract.log").read_text()
    )


def test_convert_exports_pass_the_load_back_gate(ci_run):
    r = result(ci_run[0], "03_convert")["figures"]
    assert set(r["exports"]) == {"sglang", "vllm", "speculators"}
    for name, v in r["verified"].items():
        assert v["ok"] and v["loaded"] == v["expected"] and v["skipped"] == 0, (name, v)
    assert any("--speculative-num-draft-tokens 6" in c for c in r["launch_commands"].values())
    if os.environ.get("CI"):  # CI builds both engine environments: every export checked by its engine's code
        assert set(r["verified"]) == set(convert_notebook.GATE) and r["not_checked"] == {}, r["not_checked"]


def test_convert_refuses_a_corrupt_drafter_and_a_plain_run_trains_it_again(ci_run, tmp_path, capsys):
    """A copy of the ci run whose trained drafter was cut short: 03_convert alone fails with the reason; a plain run
    sees the damage in 02_train's files, trains again (from its last good checkpoint) and converts."""
    run_dir, overrides = ci_run
    copy = tmp_path / run_dir.name
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("04_deploy", "05_benchmark"))
    weights = copy / "02_train" / "drafter" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    here = overrides | {"run.output_root": str(tmp_path)}
    with pytest.raises(pipeline.StageError, match="03_convert"):
        pipeline.run_pipeline(ROOT / "tests" / "params" / "ci.yaml", here, only_stage="convert", log_output=False)
    failed = result(copy, "03_convert")
    assert failed["status"] == "failed" and "model.safetensors is not a readable safetensors file" in failed["error"]
    capsys.readouterr()
    pipeline.run_pipeline(ROOT / "tests" / "params" / "ci.yaml", here, to_stage="convert", log_output=False)
    err = capsys.readouterr().err
    assert "02_train: 1 of its files changed since it made them (drafter/model.safetensors: 4096 bytes" in err, err
    assert "01_extract: unchanged, skipped" in err
    assert result(copy, "02_train")["status"] == result(copy, "03_convert")["status"] == "ok"


def test_deploy_served_the_drafter_and_left_no_process(ci_run):
    """Read from /proc after the stage, not from what the stage says of itself: none of the processes that served
    (a pid with its start time) runs, and nothing is left in the engine's process group."""
    r = result(ci_run[0], "04_deploy")["figures"]
    assert r["ready_s"] > 0 and (ci_run[0] / "04_deploy" / r["log"]).is_file()
    served_by = {int(pid): start for pid, start in r["served_by"].items()}
    assert r["group"] in served_by and len(served_by) >= 2, served_by  # the guard and the engine at least
    assert engines.process_starts(list(served_by)).items().isdisjoint(served_by.items())
    assert engines.alive_in_group(r["group"]) == []
    assert r["smoke"]["completion_tokens"] > 0 and r["smoke"]["drafts"] > 0


def test_benchmark_is_lossless_in_fp32_and_measures_acceptance(ci_run):
    r = result(ci_run[0], "05_benchmark")["figures"]
    model = r["cost_model"]
    plan = model["plan"]  # the cost model's pick first (it calibrates), then bench.depths (ci.yaml: no neighbours)
    assert plan[0] == model["calibrated_on"] == model["picks"]["1"] and 5 in plan and len(set(plan)) == len(plan)
    assert [(row["config"], row["concurrency"]) for row in r["rows"]] == [("baseline-float32", 1)] + [
        (f"depth{d}-float32", 1) for d in plan
    ]
    assert len(model["predicted"]) == 5 and all(x["speedup"] > 0 for x in model["predicted"])
    sized = r["sizing"]  # run.minutes 90: every prompt fits, and the sweep expected no fewer configurations than ran
    assert sized["prompts"] == sized["asked"] == len(r["prompt_list"]) and sized["configurations"] >= len(r["rows"])
    assert 0 < sized["estimate_s"] < sized["seconds_left"], sized
    for row in r["rows"][1:]:
        assert row["drafts"] > 0 and row["accept_len"] >= 1.0 and len(row["per_pos"]) == row["depth"]
        assert row["lossless_frac"] == 1.0, r["differences"]
        assert row["predicted_speedup"] > 0 and row["calibration"] == (row["depth"] == plan[0])
    base = r["rows"][0]["tokens_per_s"]
    assert r["recommendation"]["1"]["tokens_per_s"] >= round(base, 1)  # never a depth slower than no speculation
    assert (ci_run[0] / "05_benchmark" / "speedup_vs_depth.png").is_file()


def test_benchmark_replay_matches_the_engine(ci_run):
    """The replay of greedy speculative decoding with our drafter against the HF target (fp32 in ci) gives the
    engine's no-speculation outputs, token for token, and the acceptance vLLM measured with the same drafter."""
    run_dir = ci_run[0]
    rows = result(run_dir, "05_benchmark")["figures"]["rows"]
    prov = replay.load(run_dir / "05_benchmark" / "provenance.json")
    figures = result(run_dir, "05_benchmark")["figures"]
    best = max((r for r in figures["rows"] if r["depth"]), key=lambda r: r["speedup"])["depth"]
    picks = figures["cost_model"]["picks"].values()
    assert prov["depths"] == sorted({5, best, *picks}) and prov["target_dtype"] == "float32"
    assert len(prov["prompts"]) == 4
    for rec in prov["prompts"]:
        at5 = rec["replays"]["5"]
        assert at5["equals_baseline"], rec["id"]
        assert len(at5["source"]) == 32 and max(at5["source"]) <= 5
        assert "".join(at5["pieces"]) and at5["pieces"] == rec["baseline"]["pieces"]
    engine = next(row for row in rows if row["config"] == "depth5-float32")
    # both sides are fp32 greedy over the same prompts: per-position acceptance agrees to a draft or two in ~30
    # verify steps (the ci drafter's ~0.1 at position 1; a drafter fed wrong aux states in the engine gets ~0)
    assert engine["per_pos"][0] > 0.05, engine  # there is acceptance to compare
    replayed = prov["summary"]["5"]
    assert replayed["per_pos"][:2] == pytest.approx(engine["per_pos"][:2], abs=0.04)
    assert replayed["accept_len"] == pytest.approx(engine["accept_len"], rel=0.05)
    # the report shows it: the summary table and a coloured prompt
    page = (run_dir / "05_benchmark" / "05_benchmark.html").read_text()
    assert "replay accept len" in page and "from the target (prefill or verification)" in page
