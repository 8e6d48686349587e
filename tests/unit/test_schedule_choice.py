"""speedup/schedule.py chooses the depth per load from measured rows; speedup/under_load.py holds the deployed
schedule against the fixed configurations; engines/serving_bench.py reads both tools' results alike."""

import json

import pytest

from eagle3lib.engines.schedule import DepthSchedule
from eagle3lib.engines.serving_bench import LoadPoint, SglangBenchServing, VllmBenchServe, figures
from eagle3lib.params import BenchParams
from eagle3lib.speedup import load, schedule, sizing, under_load


def row(depth, concurrency, tokens_per_s, itl=None, prompts=12, **extra):
    config = "baseline" if depth == 0 else f"depth{depth}"
    return {"depth": depth, "config": config, "concurrency": concurrency, "tokens_per_s": tokens_per_s,
            "prompts": prompts, "p90_itl_ms": itl, "schedule": None, **extra}  # fmt: skip


# Speculation pays at low load and loses at high load: depth 3 at 1, depth 1 at 4, none at 8 and 16.
ROWS = [
    row(0, 1, 20), row(1, 1, 26), row(3, 1, 31),
    row(0, 4, 60), row(1, 4, 66), row(3, 4, 62),
    row(0, 8, 100), row(1, 8, 92), row(3, 8, 70),
    row(0, 16, 150), row(1, 16, 120), row(3, 16, 80),
]  # fmt: skip


def test_the_fastest_configuration_at_each_load_becomes_a_step_and_no_speculation_is_a_step_too():
    derived = schedule.derive(ROWS)
    assert derived["schedule"] == DepthSchedule(((1, 3), (4, 1), (8, 0)))  # 8 and 16 merge into one step
    assert [s["config"] for s in derived["steps"]] == ["depth3", "depth1", "baseline", "baseline"]
    assert derived["schedule"].vllm_ranges()[-1][2] == 0


def test_rows_on_fewer_prompts_and_a_schedules_own_rows_do_not_compete():
    quick = [row(5, 1, 99, prompts=2), row(2, 1, 98, schedule=[[1, 2]])]
    assert schedule.derive(ROWS + quick)["schedule"] == DepthSchedule(((1, 3), (4, 1), (8, 0)))


def test_a_latency_target_takes_the_fastest_within_it_and_says_where_none_meets_it():
    rows = [
        row(0, 1, 20, itl=50), row(3, 1, 31, itl=35),
        row(0, 8, 100, itl=80), row(3, 8, 110, itl=95),  # depth 3 is faster at 8 but over the target
        row(0, 16, 150, itl=130), row(3, 16, 120, itl=140),  # nothing within 60 ms at 16
    ]  # fmt: skip
    derived = schedule.derive(rows, itl_p90_ms=90)
    at = {s["concurrency"]: s for s in derived["steps"]}
    assert at[1]["depth"] == 3 and at[1]["meets_target"]
    assert at[8]["depth"] == 0 and at[8]["meets_target"] and "<= 90 ms" in at[8]["why"]
    assert at[16]["depth"] == 0 and not at[16]["meets_target"] and "no configuration meets" in at[16]["why"]
    derived = schedule.derive(rows, itl_p90_ms=40)  # only depth 3 at 1 meets it; elsewhere the lowest latency
    assert derived["schedule"] == DepthSchedule(((1, 3), (8, 0)))
    assert [s["meets_target"] for s in derived["steps"]] == [True, False, False]


def test_no_measured_row_is_refused():
    with pytest.raises(ValueError, match="no measured rows"):
        schedule.derive([])


def load_row(config, load, rate, concurrency, tokens_per_s, sched=None):
    return {"config": config, "load": load, "rate": rate, "concurrency": concurrency, "tokens_per_s": tokens_per_s,
            "schedule": sched, "p90_itl_ms": 10.0, "completed": 8}  # fmt: skip


def test_the_schedule_is_held_against_the_best_fixed_configuration_at_each_load():
    sched = [[1, 3], [8, 0]]
    rows = [
        load_row("baseline", "closed loop, 1 in flight", None, 1, 20), load_row("depth3", "closed loop, 1 in flight", None, 1, 30),
        load_row("baseline", "closed loop, 8 in flight", None, 8, 100), load_row("depth3", "closed loop, 8 in flight", None, 8, 70),
        load_row("schedule-3.0", "closed loop, 1 in flight", None, 1, 29.5, sched),
        load_row("schedule-3.0", "closed loop, 8 in flight", None, 8, 90, sched),
    ]  # fmt: skip
    got = under_load.schedule_against_fixed(rows)
    assert [round(p["against_best"], 3) for p in got["points"]] == [0.983, 0.9]
    assert got["short_at"] == ["closed loop, 8 in flight"] and not got["holds"]
    assert got["means"]["schedule"] == pytest.approx(59.75) and got["mean_beaten_by"] == ["baseline"]
    text = under_load.schedule_text({"text": "t", "steps": [], "deployed": True}, got)
    assert "below 0.97x the best fixed configuration at: closed loop, 8 in flight" in text
    assert under_load.schedule_against_fixed(rows[:4]) is None


RESULT = {"completed": 8, "total_output_tokens": 512, "duration": 4.0, "output_throughput": 128.0,
          "request_throughput": 2.0, "median_ttft_ms": 40.0, "p90_ttft_ms": 55.0, "p99_ttft_ms": 60.0,
          "median_itl_ms": 7.0, "p90_itl_ms": 9.0, "p99_itl_ms": 12.0, "median_tpot_ms": 7.5,
          "p90_tpot_ms": 8.0, "p99_tpot_ms": 9.5}  # fmt: skip


def test_both_tools_results_read_alike(tmp_path):
    got = figures(RESULT)
    assert got["tokens_per_s"] == 128.0 and got["p50_ttft_ms"] == 40.0 and got["p90_itl_ms"] == 9.0
    (tmp_path / "v.json").write_text(json.dumps(RESULT))
    (tmp_path / "s.jsonl").write_text(json.dumps({"completed": 1}) + "\n" + json.dumps(RESULT) + "\n")
    assert VllmBenchServe().read(tmp_path / "v.json") == SglangBenchServing().read(tmp_path / "s.jsonl")


def test_each_tool_is_asked_for_the_load_point_it_runs(tmp_path):
    class Server:
        url, model = "http://127.0.0.1:8000", "m"

    point = LoadPoint(2.0, 8)
    vllm = VllmBenchServe().command("py", Server, "/t", tmp_path / "p.jsonl", 8, 64, point, tmp_path / "o.json")
    assert vllm[vllm.index("--request-rate") + 1] == "2.0" and vllm[vllm.index("--max-concurrency") + 1] == "8"
    assert vllm[vllm.index("--sharegpt-output-len") + 1] == "64" and "--ignore-eos" in vllm
    sglang = SglangBenchServing().command(
        "py", Server, "/t", tmp_path / "p.jsonl", 8, 64, LoadPoint(None, 4), tmp_path / "o"
    )
    assert sglang[sglang.index("--request-rate") + 1] == "inf" and sglang[sglang.index("--max-concurrency") + 1] == "4"
    assert point.name() == "2 req/s, 8 in flight" and LoadPoint(None, 1).name() == "closed loop, 1 in flight"


def test_load_points_are_each_concurrency_closed_loop_then_each_rate_capped_at_the_highest():
    bench = BenchParams(concurrency=[8, 1], load_rates=[0.5, 4])
    assert load.load_points(bench) == [LoadPoint(None, 1), LoadPoint(None, 8), LoadPoint(0.5, 8), LoadPoint(4, 8)]


def test_the_load_sends_first_turns_of_every_set_as_text():
    prompts = [
        {"id": "a/1", "set": "a", "turn": 1, "prompt_ids": [1]},
        {"id": "a/1/2", "set": "a", "turn": 2, "prompt_ids": None},
        {"id": "b/1", "set": "b", "turn": 1, "prompt_ids": [2]},
        {"id": "context/1", "set": "context", "turn": 1, "prompt_ids": [3] * 50},
    ]
    assert load.load_texts(prompts, lambda ids: f"text{ids[0]}", 5) == ["text1", "text2"]


def test_the_sizing_prices_each_load_point_at_its_cap_or_its_arrivals():
    speeds = sizing.Speeds(start_s=60, step_s={1: 0.05, 8: 0.1}, prefill_s_per_token=0)
    closed = sizing.load_seconds(speeds, [LoadPoint(None, 1), LoadPoint(None, 8)], 8, 10)
    assert closed == pytest.approx(2 * sizing.TOOL_START_S + 8 * 10 * 0.05 + 1 * 10 * 0.1)
    slow_arrivals = sizing.load_seconds(speeds, [LoadPoint(0.5, 8)], 8, 10)  # 16 s of arrivals, 1 s of decoding
    assert slow_arrivals == pytest.approx(sizing.TOOL_START_S + 16)


def test_sglangs_tool_without_datasets_says_what_to_install():
    fix = SglangBenchServing().fix("ModuleNotFoundError: No module named 'datasets'", "/env/bin/python")
    assert fix.endswith("/env/bin/python -m pip install datasets")
    assert SglangBenchServing().fix("some other failure", "/env/bin/python") is None
