"""bench/sweep.py: predicted acceptance, losslessness, the report, and one real sweep on the vLLM CPU server."""

import pytest
from conftest import FAST_START
from drafters import MAX_TOKENS, PROMPTS
from test_engines import drafts, need  # noqa: F401  (the learned drafter's exports; a module-scoped fixture)

from eagle3lib import engines
from eagle3lib.bench import sweep
from eagle3lib.params import BenchParams, EngineParams
from eagle3lib.train.metrics import acceptance_summary


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
    cmp = sweep.compare_outputs(spec, base)
    assert cmp["lossless_frac"] == 0.5
    assert cmp["differences"] == [{"id": "b", "first_diff": 1, "baseline": "de", "speculative": "dX"}]
    # a prefix is not a match (an engine that stopped early), and outputs pair by prompt id, not by order
    short = [{"id": "b", "token_ids": [4, 5], "text": "de"}, {"id": "a", "token_ids": [1, 2], "text": "ab"}]
    cmp = sweep.compare_outputs(short, base)
    assert cmp["lossless_frac"] == 0.5 and [(d["id"], d["first_diff"]) for d in cmp["differences"]] == [("a", 2)]
    longer = [{"id": "a", "token_ids": [1, 2, 3, 9], "text": "abcX"}]
    assert sweep.compare_outputs(longer, base)["differences"][0]["first_diff"] == 3
    with pytest.raises(ValueError, match=r"no baseline output for prompt\(s\) \['z'\]"):
        sweep.compare_outputs([{"id": "z", "token_ids": [], "text": ""}], base)


ROWS = [
    {
        "engine": "vllm",
        "config": "baseline",
        "depth": 0,
        "concurrency": 1,
        "tokens_per_s": 28.0,
        "tpot_ms": 35.0,
        "speedup": 1.0,
        "accept_len": None,
        "per_pos": [],
        "lossless_frac": 1.0,
        "predicted_accept_len": None,
    },
    {
        "engine": "vllm",
        "config": "depth5",
        "depth": 5,
        "concurrency": 1,
        "tokens_per_s": 56.0,
        "tpot_ms": 18.0,
        "speedup": 2.0,
        "accept_len": 2.4,
        "per_pos": [0.7, 0.4, 0.2, 0.1, 0.0],
        "lossless_frac": 1.0,
        "predicted_accept_len": 2.5,
        "predicted_per_pos": [0.7, 0.45, 0.2, 0.1, 0.05],
        "efficiency": 2 / 2.4,
    },
    {
        "engine": "vllm",
        "config": "baseline",
        "depth": 0,
        "concurrency": 8,
        "tokens_per_s": 160.0,
        "tpot_ms": 50.0,
        "speedup": 1.0,
        "accept_len": None,
        "per_pos": [],
        "lossless_frac": 1.0,
        "predicted_accept_len": None,
    },
    {
        "engine": "vllm",
        "config": "depth5",
        "depth": 5,
        "concurrency": 8,
        "tokens_per_s": 150.0,
        "tpot_ms": 52.0,
        "speedup": 150 / 160,
        "accept_len": 2.4,
        "per_pos": [0.7, 0.4, 0.2, 0.1, 0.0],
        "lossless_frac": 0.75,
        "predicted_accept_len": 2.5,
        "predicted_per_pos": [0.7, 0.45, 0.2, 0.1, 0.05],
        "efficiency": 0.39,
    },
]


def test_recommendation_table_and_plots(tmp_path):
    rec = sweep.recommend(ROWS, "/models/t", {"vllm": "/x/vllm", "sglang": "/x/sglang"})
    assert rec["1"]["config"] == "depth5" and rec["8"]["config"] == "baseline"
    assert (
        '"num_speculative_tokens": 5' in rec["1"]["vllm"] and "--speculative-num-draft-tokens 6" in rec["1"]["sglang"]
    )
    assert "--speculative" not in rec["8"]["vllm"] + rec["8"]["sglang"]
    from eagle3lib.workbook import plots, report

    page = report.table_html(sweep.table(ROWS))
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
    """Baseline + one depth at two concurrencies on the real server with the learned drafter: most drafts are
    accepted (so the comparison exercises accepted chains, not just the baseline against itself), and fp32
    greedy outputs are identical."""
    need("vllm")
    tokenizer = embedded_target[1]
    conv = [{"id": f"p{i}", "messages": [{"role": "user", "content": PROMPTS[0]}]} for i in range(3)]
    prompts = sweep.prompt_ids(tokenizer, conv, 3)
    assert all(p["prompt_ids"] == learned["prompts"][0] for p in prompts)
    params = BenchParams(depths=[3], concurrency=[1, 3], num_prompts=3, max_tokens=MAX_TOKENS, dtype="float32")
    swept = sweep.benchmark(
        EngineParams(extra_args=FAST_START),
        params,
        drafts["target"],
        drafts["vllm"],
        prompts,
        tmp_path,
        eval_summary=acceptance_summary([0.1], [0.1], 3),
    )
    rows = swept["rows"]
    assert [(r["config"], r["concurrency"]) for r in rows] == [
        ("baseline-float32", 1),
        ("baseline-float32", 3),
        ("depth3-float32", 1),
        ("depth3-float32", 3),
    ]
    for r in rows[2:]:
        assert r["drafts"] > 0 and len(r["per_pos"]) == 3 and r["per_pos"][0] > 0.5, r  # drafts were accepted
        assert r["predicted_accept_len"] == pytest.approx(1.111)
    for r in rows:
        assert r["completion_tokens"] == 3 * MAX_TOKENS and r["tokens_per_s"] > 0 and r["lossless_frac"] == 1.0, r
    assert swept["differences"] == [] and swept["baseline_agreement_across_concurrency"] == 1.0
    assert swept["baseline_outputs"]["1"][0]["token_ids"] == learned["greedy"][0]  # = HF greedy in this process
    assert {(tmp_path / "vllm-baseline-float32.log").is_file(), (tmp_path / "vllm-depth3-float32.log").is_file()} == {
        True
    }
    assert all(engines.alive_in_group(r["group"]) == [] for r in rows), "a configuration's server survived"
