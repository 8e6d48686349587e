"""speedup/sizing.py: the benchmark's prompts sized to the run's time left (run.minutes), and where that time
comes from (run_folder.seconds_before, Stage.deadline)."""

import json

import pytest

from eagle3lib import params
from eagle3lib.params import BenchParams
from eagle3lib.speedup import plan, prompt_sets, sizing
from eagle3lib.workbook.stage import open_stage

# 2 cores without native bf16: 16 tokens/s at concurrency 1, ~45 at 8, a 55 s server start
SPEEDS = sizing.Speeds(start_s=55.0, step_s={1: 1 / 16, 8: 8 / 45}, prefill_s_per_token=0.004)


def prompts_of_issue_43():
    """The CPU recipe's 26 requests: 6 held-out, 6 MT-Bench questions of two turns, 6 HumanEval, 2 long contexts."""
    out = [{"id": f"h{i}", "set": "held_out", "prompt_ids": [1] * 80} for i in range(6)]
    for i in range(6):
        out += [
            {"id": f"m{i}", "set": "mt_bench", "prompt_ids": [1] * 60},
            {"id": f"m{i}#2", "set": "mt_bench", "prompt_ids": None, "after": f"m{i}", "turn": 2},
        ]
    out += [{"id": f"e{i}", "set": "humaneval", "prompt_ids": [1] * 150} for i in range(6)]
    out += [{"id": f"context/{n}", "set": prompt_sets.CONTEXT, "prompt_ids": [1] * n} for n in (2000, 6000)]
    return out


def test_the_prompts_fit_the_time_left_with_every_set_kept():
    prompts = prompts_of_issue_43()
    every = sizing.fit(prompts, SPEEDS, 3600 * 2, 4, 96, [1, 8])
    assert every.prompts == prompts and not every.sized
    assert "all 26 prompts fit the run's time" in every.text()
    # such a run: four configurations of ~7.5 min; here 12 minutes are left
    sized = sizing.fit(prompts, SPEEDS, 12 * 60, 4, 96, [1, 8])
    assert sized.sized and sized.estimate_s <= 12 * 60 - sizing.TAIL_S < sized.asked_estimate_s
    ids = [p["id"] for p in sized.prompts]
    assert {p["set"] for p in sized.prompts} == {"held_out", "mt_bench", "humaneval"}  # the long contexts go first
    assert all(p["after"] in ids for p in sized.prompts if p.get("after")), "a later turn without its first"
    assert ids == [p["id"] for p in prompts if p["id"] in ids], "the asked order is kept"
    assert f"sized to {len(ids)} of 26 prompts: 26 would take about" in sized.text()
    # one more prompt would not have fitted
    more = prompt_sets.take([p for p in prompts if p["set"] != prompt_sets.CONTEXT], len(ids) + 1)
    assert 4 * sizing.config_seconds(SPEEDS, more, 96, [1, 8]) > 12 * 60 - sizing.TAIL_S


def test_the_fewest_cover_every_set():
    prompts = prompts_of_issue_43()
    hopeless = sizing.fit(prompts, SPEEDS, 10, 4, 96, [1, 8])
    assert [p["id"] for p in hopeless.prompts] == ["h0", "m0", "e0"]
    assert "(the fewest that cover every set, still over it)" in hopeless.text()
    assert json.dumps(hopeless.as_dict())  # result.json's sizing


def test_the_configurations_a_sweep_expects():
    bench = BenchParams(depths=[16, 10, 5], concurrency=[1, 8], asked_depths="predict", neighbours=False)
    # the baseline, the first pick, the calibrated picks at c=1 and c=8 (a run measured depth 3, then 4 and 2)
    assert plan.expected_configurations(bench, cost_model=True) == 4
    assert plan.expected_configurations(bench.model_copy(update={"neighbours": True}), True) == 6
    assert plan.expected_configurations(bench.model_copy(update={"asked_depths": "quick"}), True) == 7
    assert plan.expected_configurations(bench, cost_model=False) == 4


def test_the_deadline_is_the_budget_less_what_the_stages_before_took(tmp_path):
    pfile = tmp_path / "p.yaml"
    pfile.write_text("run: {name: r, minutes: 30}\n")
    run_dir = tmp_path / "run"
    for stage, seconds in (("00_prepare", 300.0), ("02_train", 200.5), ("05_benchmark", 999)):
        (run_dir / stage).mkdir(parents=True)
        (run_dir / stage / "result.json").write_text(json.dumps({"status": "ok", "seconds": seconds}))
    (run_dir / "01_extract").mkdir()
    (run_dir / "01_extract" / "result.json").write_text("{")  # torn: counts as not run, 0 s
    stage = open_stage("05_benchmark", pfile, run_dir)
    assert stage.deadline == pytest.approx(stage.started + 1800 - 500.5)
    pfile.write_text("run: {name: r}\n")
    assert open_stage("05_benchmark", pfile, run_dir).deadline is None
    with pytest.raises(params.ParamsError, match="minutes"):
        params.load_params(pfile, {"run.minutes": 0})
