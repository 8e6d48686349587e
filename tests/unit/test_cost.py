"""The cost model predicts tokens/s per depth from measured costs; checked on synthetic timings."""

import pytest

from eagle3lib.speedup import cost, recommend


def synthetic(prefill_share=0.0, overhead=0.0):
    # A target whose forward costs 10 ms + 1 ms per token, a drafter step of 0.5 ms per token.
    forward = {m: 10.0 + m for m in (1, 2, 4, 8, 16, 32, 64, 136)}
    draft = {m: 0.5 * m for m in (1, 2, 4, 8, 16, 32, 64, 136)}
    decode = {1: 22.0, 8: 36.0}  # the engine's step: 2x the in-process forward
    return cost.Costs(decode, forward, draft, {1: prefill_share, 8: prefill_share}, {1: overhead, 8: overhead})


def test_timings_are_read_through_a_monotone_line():
    assert cost.line({1: 11.0, 4: 14.0, 8: 18.0}) == pytest.approx((10.0, 1.0))
    # the jitter of single timings on a busy CPU (recorded on 2 cores: 95, 146, 169, 148, 136 ms for 1, 2, 3,
    # 4, 6 tokens) averages out instead of making a deeper chain look cheaper
    intercept, slope = cost.line({1: 95.0, 2: 146.0, 3: 169.0, 4: 148.0, 6: 136.0, 16: 169.0, 32: 276.0})
    assert slope > 0 and intercept > 95.0
    assert cost.line({1: 20.0, 2: 10.0}) == (15.0, 0.0)  # never falling
    assert cost.line({4: 7.0}) == (7.0, 0.0)


def test_acceptance_is_the_product_of_conditional_rates():
    a = cost.acceptance([0.5, 0.5], 3)
    assert a["per_pos"] == pytest.approx([0.5, 0.25, 0.125])
    assert a["accept_len"] == pytest.approx(1.875)
    assert cost.acceptance([0.8], 1, scale=2.0)["per_pos"] == [1.0]  # capped


def test_step_time_and_speedup_by_hand():
    c = synthetic()
    # depth 2 at concurrency 1: verify 3 tokens (13 ms) + 2 draft steps (1 ms) over a 1-token forward (11 ms)
    assert cost.step_ms(c, 2, 1) == pytest.approx(22.0 * 14.0 / 11.0)
    rows = cost.predict(c, [0.6, 0.5], [2], [1])
    al = 1 + 0.6 + 0.3
    assert rows[0]["accept_len"] == pytest.approx(al)
    assert rows[0]["speedup"] == pytest.approx(al * 22.0 / (22.0 * 14.0 / 11.0))


def test_prefill_share_caps_the_speedup():
    free = cost.predict(synthetic(), [0.9], [3], [1])[0]["speedup"]
    half = cost.predict(synthetic(prefill_share=0.5), [0.9], [3], [1])[0]["speedup"]
    assert half == pytest.approx(1 / (0.5 + 0.5 / free))


def test_best_depth_falls_as_acceptance_falls_and_costs_rise():
    depths = range(1, 17)
    strong = cost.best_depth(cost.predict(synthetic(), [0.9] * 5, depths, [1, 8]), 1)
    weak = cost.best_depth(cost.predict(synthetic(), [0.3] * 5, depths, [1, 8]), 1)
    assert strong["depth"] > weak["depth"] >= 1
    slow_drafter = synthetic()
    slow_drafter.draft_ms = {m: 10 * v for m, v in slow_drafter.draft_ms.items()}
    assert cost.best_depth(cost.predict(slow_drafter, [0.9] * 5, depths, [1]), 1)["depth"] < strong["depth"]
    # a fixed cost per speculative step is shared by more tokens in a longer chain
    fixed = cost.best_depth(cost.predict(synthetic(overhead=20.0), [0.9] * 5, depths, [1]), 1)
    assert fixed["depth"] >= strong["depth"]
    # at concurrency 8 each verified token is 8 tokens of work: deeper chains cost more
    assert cost.best_depth(cost.predict(synthetic(), [0.9] * 5, depths, [8]), 8)["depth"] <= strong["depth"]


def test_calibration_recovers_a_hidden_overhead_and_acceptance_scale():
    truth = synthetic(prefill_share=0.2, overhead=7.0)
    truth.acceptance_scale = 0.8
    train_cond = [0.7, 0.6, 0.6]
    measured_rows = []
    for r in cost.predict(truth, train_cond, [3], [1, 8]):
        per_pos = cost.acceptance(train_cond, 3, 0.8)["per_pos"]
        measured_rows.append({**r, "per_pos": per_pos})
    fitted = cost.calibrate(synthetic(prefill_share=0.2), train_cond, measured_rows)
    assert fitted.overhead_ms == pytest.approx({1: 7.0, 8: 7.0})
    assert fitted.calibrated_on == {"depths": [3], "concurrency": [1, 8]}
    assert fitted.acceptance_scale == pytest.approx(0.8)
    for want, got in zip(
        cost.predict(truth, train_cond, range(1, 17), [1, 8]), cost.predict(fitted, train_cond, range(1, 17), [1, 8])
    ):
        assert got["speedup"] == pytest.approx(want["speedup"])


def test_calibration_on_several_depths_takes_the_mean_residual():
    """Two depths whose measured steps sit 4 ms and 10 ms above the model: the overhead is 7 ms, and the
    baseline rows (depth 0) and rows without acceptance do not count."""
    model = synthetic()
    rows = []
    for depth, extra in ((1, 4.0), (4, 10.0)):
        al = 1.5
        step = cost.step_ms(model, depth, 1) + extra
        rows.append({"depth": depth, "concurrency": 1, "accept_len": al, "speedup": al * 22.0 / step})
    rows += [{"depth": 0, "concurrency": 1, "speedup": 1.0, "accept_len": None}]
    fitted = cost.calibrate(model, [0.5], rows)
    assert fitted.overhead_ms[1] == pytest.approx(7.0) and fitted.overhead_ms[8] == 0.0
    assert fitted.calibrated_on == {"depths": [1, 4], "concurrency": [1]}


def test_decode_costs_from_baseline_rows():
    rows = [
        {"concurrency": 1, "tokens_per_s": 40.0, "prefill_s": 1.0, "decode_s": 3.0},
        {"concurrency": 8, "tokens_per_s": 160.0},
    ]
    decode, share = cost.decode_costs(rows)
    assert share == {1: 0.25, 8: 0.0}
    assert decode == pytest.approx({1: 0.75 * 25.0, 8: 50.0})


def test_limits_split_a_measured_step_and_say_what_bounds_it():
    """A row measured on an engine with 3 ms of its own per step: the split gives back verify, drafts and the
    3 ms; full acceptance and the acceptance needed for 1.5x follow from the same step time."""
    truth = synthetic(prefill_share=0.1, overhead=3.0)
    al = 1.4
    row = {"depth": 2, "concurrency": 1, "accept_len": al}
    row["speedup"] = cost.speedup(truth, 1, al, cost.step_ms(truth, 2, 1))
    x = cost.limits(synthetic(prefill_share=0.1), row)
    # verify 3 tokens = 13 ms, 2 draft steps = 1 ms, over an 11 ms one-token forward, scaled to a 22 ms decode step
    assert x["verify_decode_steps"] == pytest.approx(13.0 / 11.0)
    assert x["drafts_decode_steps"] == pytest.approx(1.0 / 11.0)
    assert x["engine_decode_steps"] == pytest.approx(3.0 / 22.0)
    step = 22.0 * 14.0 / 11.0 + 3.0
    assert x["step_decode_steps"] == pytest.approx(step / 22.0)
    assert x["all_accepted_speedup"] == pytest.approx(1 / (0.1 + 0.9 * step / (3 * 22.0)))
    assert cost.speedup(truth, 1, x["accept_len_needed"], step) == pytest.approx(1.5)
    assert x["limited_by"] == "acceptance" and x["prefill_cap"] == pytest.approx(10.0)
    # a step that costs more than 2 decode steps cannot reach 1.5x at depth 1 even with every draft accepted
    slow = synthetic()
    slow.draft_ms = {m: 30.0 * m for m in slow.draft_ms}
    row1 = {"depth": 1, "concurrency": 1, "accept_len": 1.9}
    row1["speedup"] = cost.speedup(slow, 1, 1.9, cost.step_ms(slow, 1, 1))
    assert cost.limits(slow, row1)["limited_by"] == "step cost"
    # prefill at 70% of the time caps any speedup at 1/0.7 < 1.5
    assert cost.limits(synthetic(prefill_share=0.7), row)["accept_len_needed"] is None


def test_the_limits_text_reads_a_recorded_sweep():
    from eagle3lib.speedup import notebook

    model = synthetic(overhead=2.0)
    rows = [{"depth": 0, "concurrency": 1, "speedup": 1.0, "prompts": 12}]
    for depth, al in ((1, 1.3), (3, 1.5)):
        x = cost.speedup(model, 1, al, cost.step_ms(model, depth, 1))
        rows.append({"depth": depth, "concurrency": 1, "speedup": x, "accept_len": al, "prompts": 12})
    recorded = {"costs": {k: ({str(i): v for i, v in d.items()} if isinstance(d, dict) else d)
                          for k, d in model.as_dict().items()}}  # fmt: skip
    (fastest,) = notebook.speedup_limits({"rows": rows, "cost_model": recorded})
    assert fastest["depth"] == max(rows[1:], key=lambda r: r["speedup"])["depth"]
    assert fastest["engine_decode_steps"] == pytest.approx(2.0 / 22.0)
    text = notebook.limits_text([fastest])
    assert f"depth {fastest['depth']}" in text and "Limited by acceptance" in text
    # a sweep without the cost model: the step from the baseline's rows, not split
    rows[0] |= {"tokens_per_s": 1000 / 22.0, "prefill_s": 0.0, "decode_s": 1.0}
    (unsplit,) = notebook.speedup_limits({"rows": rows, "cost_model": None})
    assert unsplit["step_decode_steps"] == pytest.approx(fastest["step_decode_steps"])
    assert unsplit["verify_decode_steps"] is None and "not split" in notebook.limits_text([unsplit])


class SyntheticEngine:
    """A sweep on an engine whose speed follows known costs: measure(depth, prompts, ...) returns the rows
    sweep.Sweep.measure would, computed from `truth` (a Costs) and an acceptance the engine measures."""

    def __init__(self, truth, engine_cond, concurrency, prompts):
        self.truth, self.cond, self.concurrency, self.runs, self.rows = truth, engine_cond, concurrency, [], []
        self.prompts = prompts

    def say(self, line):
        pass

    def expect(self, configurations):
        pass

    def measure(self, depth, used, prediction=None, note="", calibration=False, concurrency=None):
        self.runs.append((depth, len(used), calibration))
        out = []
        for c in concurrency or self.concurrency:
            if depth is None:
                share = self.truth.prefill_share[c]  # as the engine's counters report it
                tps = (1 - share) * c * 1000 / self.truth.decode_ms[c]
                r = {"depth": 0, "concurrency": c, "tokens_per_s": tps, "speedup": 1.0}
                r |= {"prefill_s": share, "decode_s": 1 - share}
            else:
                acc = cost.acceptance(self.cond, depth)
                x = cost.speedup(self.truth, c, acc["accept_len"], cost.step_ms(self.truth, depth, c))
                base = next(b for b in self.rows if b["depth"] == 0 and b["concurrency"] == c)
                r = {"depth": depth, "concurrency": c, "tokens_per_s": x * base["tokens_per_s"], "speedup": x}
                r |= {"accept_len": acc["accept_len"], "per_pos": acc["per_pos"]}
            r |= {"prompts": len(used), "config": f"depth{depth}" if depth else "baseline", "lossless_frac": 1.0}
            if prediction is not None:
                r["predicted_speedup"] = prediction[(depth, c)]["speedup"]
            self.rows.append(r)
            out.append(r)
        return out


def test_the_sweep_measures_the_true_best_depth_and_recommends_only_what_beat_the_baseline():
    from eagle3lib.params import BenchParams
    from eagle3lib.speedup import plan

    truth = synthetic(prefill_share=0.1, overhead=6.0)
    train_cond = [0.75, 0.7, 0.7, 0.65, 0.6]
    engine_cond = [0.6, 0.56, 0.56, 0.52, 0.48]  # the engine accepts less than training predicted (scale 0.8)
    bench = BenchParams(depths=[16, 10, 5], concurrency=[1, 8], quick_below=0.75, quick_prompts=8)
    prompts = [{"id": str(i), "prompt_ids": [1]} for i in range(12)]
    engine = SyntheticEngine(truth, engine_cond, bench.concurrency, prompts)
    engine.measure(None, prompts)
    clean = synthetic(prefill_share=0.1)  # what the in-process probe sees: no engine overhead
    model = plan.choose_and_measure(engine, bench, {"cond_acc": train_cond}, lambda: (clean.forward_ms, clean.draft_ms))
    measured = {d for d, _, _ in engine.runs if d}
    assert engine.runs[1][2] and engine.runs[1][0] == model["calibrated_on"]  # the first pick calibrates
    true_best = {c: cost.best_depth(cost.predict(truth, engine_cond, range(1, 17), [c]), c)["depth"] for c in (1, 8)}
    assert set(true_best.values()) <= measured and {16, 10, 5} <= measured
    assert model["picks"] == {str(c): d for c, d in true_best.items()}
    for r in engine.rows:  # after calibration the model predicts every other depth exactly
        if r["depth"] and r["depth"] != model["calibrated_on"]:
            assert r["predicted_speedup"] == pytest.approx(r["speedup"], rel=1e-6)
    quick = {d for d, n, _ in engine.runs if d and n < len(prompts)}
    assert quick == set(model["quick"]) and quick
    for d in quick:
        assert all(r["speedup"] < 0.75 for r in engine.rows if r["depth"] == d)
    rec = recommend.recommend(engine.rows, "/models/t", {})
    for c, chosen in rec.items():
        base = next(r for r in engine.rows if r["depth"] == 0 and r["concurrency"] == int(c))
        assert chosen["tokens_per_s"] >= base["tokens_per_s"] and chosen["depth"] not in quick


def test_when_every_depth_loses_the_picks_still_run_every_prompt():
    """A drafter whose drafts are rarely accepted: every depth is predicted far below the baseline, the user's
    depths run quick, but the cost model's picks are measured on the full prompt set (the answer "no speculation"
    rests on them)."""
    from eagle3lib.params import BenchParams
    from eagle3lib.speedup import plan

    truth = synthetic(prefill_share=0.1, overhead=30.0)
    weak = [0.05, 0.05, 0.05]
    bench = BenchParams(depths=[16, 10], concurrency=[1, 8], max_depth=16, quick_below=0.75, quick_prompts=8)
    prompts = [{"id": str(i), "prompt_ids": [1]} for i in range(12)]
    engine = SyntheticEngine(truth, weak, bench.concurrency, prompts)
    engine.measure(None, prompts)
    model = plan.choose_and_measure(engine, bench, {"cond_acc": weak}, lambda: (truth.forward_ms, truth.draft_ms))
    full = {d for d, n, _ in engine.runs if d and n == len(prompts)}
    assert set(model["picks"].values()) <= full and {16, 10} <= set(model["quick"])
    assert all(r["speedup"] < 1 for r in engine.rows if r["depth"])
    rec = recommend.recommend(engine.rows, "/models/t", {})
    assert all(chosen["depth"] in (0, None) for chosen in rec.values())  # no speculation


@pytest.mark.parametrize("asked", ["predict", "quick"])
def test_a_first_run_sweep_measures_the_baseline_and_the_picks_and_answers_the_asked_depths_cheaply(asked):
    """bench.neighbours off and bench.asked_depths predict or quick (smollm2-135m-cpu.yaml's first run): servers start
    for the baseline and the picks only (every prompt, every concurrency); the asked depths are the calibrated
    model's predictions, or a few prompts at the lowest concurrency, and asked_depths says which."""
    from eagle3lib.params import BenchParams
    from eagle3lib.speedup import notebook, plan

    truth = synthetic(prefill_share=0.1, overhead=6.0)
    cond = [0.75, 0.7, 0.7, 0.65, 0.6]
    bench = BenchParams(depths=[16, 10, 5], concurrency=[1, 8], asked_depths=asked, neighbours=False, quick_prompts=3)
    prompts = [{"id": str(i), "prompt_ids": [1]} for i in range(12)]
    engine = SyntheticEngine(truth, cond, bench.concurrency, prompts)
    engine.measure(None, prompts)
    model = plan.choose_and_measure(engine, bench, {"cond_acc": cond}, lambda: (truth.forward_ms, truth.draft_ms))
    picks = set(model["picks"].values())
    full = {d for d, n, _ in engine.runs if d and n == len(prompts)}
    assert full == picks | {model["calibrated_on"]} and {16, 10, 5}.isdisjoint(full)  # the first pick calibrates
    swept = {"rows": engine.rows, "cost_model": model}
    answered = notebook.asked_depths(swept, bench)
    if asked == "predict":
        assert model["predicted_only"] == [16, 10, 5] and len(engine.runs) == 1 + len(full)
        assert [(r["depth"], r["concurrency"], r["how"]) for r in answered] == [
            (d, c, "predicted") for d in (16, 10, 5) for c in (1, 8)
        ]
    else:
        assert model["predicted_only"] == [] and {16, 10, 5} <= set(model["quick"])
        assert {(d, n) for d, n, _ in engine.runs if d in (16, 10, 5)} == {(16, 3), (10, 3), (5, 3)}
        assert {(r["depth"], r["concurrency"]) for r in engine.rows if r["depth"] in (16, 10, 5)} == {
            (16, 1),
            (10, 1),
            (5, 1),
        }
        hows = {(r["concurrency"], r["how"]) for r in answered}
        assert hows == {(1, "quick (3 prompts)"), (8, "predicted")}  # concurrency 8 is not run: its prediction
    assert "depth 16, concurrency 1" in notebook.asked_depths_text(answered)
    rec = recommend.recommend(engine.rows, "/models/t", {})
    assert {chosen["depth"] for chosen in rec.values()} <= picks | {0}


def predicted_rows(speedups: dict[int, list[float]], concurrency=(1, 8)) -> list[dict]:
    """cost.predict's rows with only what the plan reads: {depth: [speedup at each concurrency]}."""
    return [{"depth": d, "concurrency": c, "speedup": x} for d, xs in speedups.items() for c, x in zip(concurrency, xs)]


# depth 3 is fastest at concurrency 1, depth 2 at 8; depth 4 beats 2 at its best concurrency
SPEEDUPS = {1: [1.1, 1.05], 2: [1.3, 1.2], 3: [1.5, 1.1], 4: [1.4, 0.9], 5: [1.0, 0.6], 6: [0.7, 0.4]}


def test_the_plan_measures_the_picks_and_neighbours_fastest_first_then_the_asked_depths():
    from eagle3lib.params import BenchParams
    from eagle3lib.speedup import plan

    bench = BenchParams(depths=[6, 2, 1], concurrency=[1, 8], max_depth=6)
    todo = plan.depths_to_measure(predicted_rows(SPEEDUPS), bench, measured=[3])
    assert todo.picks == {1: 3, 8: 2}
    # the picks and the lowest pick's neighbours (2, 4) less what was measured (3), by their best speedup;
    # then the asked depths that are none of those, in the user's order
    assert todo.depths == [4, 2, 6, 1] and todo.asked == [6, 1] and todo.predicted_only == []
    alone = plan.depths_to_measure(predicted_rows(SPEEDUPS), bench.model_copy(update={"neighbours": False}), [3])
    assert alone.depths == [2, 6, 1]
    predicted = plan.depths_to_measure(
        predicted_rows(SPEEDUPS), bench.model_copy(update={"asked_depths": "predict"}), [3]
    )
    assert predicted.depths == [4, 2] and predicted.predicted_only == [6, 1]
    # neighbours stay within 1..max_depth; a depth already measured is not planned again
    edge = predicted_rows({1: [2.0, 2.0], 2: [1.0, 1.0]})
    assert plan.depths_to_measure(edge, BenchParams(depths=[2], max_depth=2), measured=[]).depths == [1, 2]
    assert plan.depths_to_measure(edge, BenchParams(depths=[2], max_depth=2), measured=[1, 2]).depths == []


def test_how_a_planned_depth_is_measured():
    from eagle3lib.params import BenchParams
    from eagle3lib.speedup import plan

    bench = BenchParams(depths=[6, 2, 1], concurrency=[1, 8], max_depth=6, quick_below=0.75, quick_prompts=3)
    rows = predicted_rows(SPEEDUPS)
    todo = plan.depths_to_measure(rows, bench, measured=[3])
    full = plan.how_to_measure(4, [r for r in rows if r["depth"] == 4], todo, bench)
    assert full == plan.Measurement(4, 1.4, False, None, None)
    # below quick_below at every concurrency: a few prompts, at least one per request in flight at the highest
    losing = predicted_rows({6: [0.7, 0.4]})
    assert plan.how_to_measure(6, losing, todo, bench) == plan.Measurement(6, 0.7, True, 8, None)
    # a pick runs every prompt however it is predicted
    assert not plan.how_to_measure(2, predicted_rows({2: [0.5, 0.6]}), todo, bench).quick
    # asked depths under asked_depths quick: quick_prompts prompts at the lowest concurrency
    asked = bench.model_copy(update={"asked_depths": "quick"})
    assert plan.how_to_measure(1, predicted_rows({1: [1.1, 1.05]}), todo, asked) == plan.Measurement(
        1, 1.1, True, 3, [1]
    )
    assert not plan.how_to_measure(4, [r for r in rows if r["depth"] == 4], todo, asked).quick  # a neighbour


def test_the_speedup_plot_draws_predictions_and_measurements(tmp_path):
    from eagle3lib.workbook import plots

    rows = [
        {"depth": 0, "concurrency": 1, "speedup": 1.0, "prompts": 12},
        {"depth": 2, "concurrency": 1, "speedup": 1.3, "prompts": 12},
        {"depth": 16, "concurrency": 1, "speedup": 0.5, "prompts": 8},
    ]
    predicted = cost.predict(synthetic(), [0.6], range(1, 17), [1])
    fig = plots.bench_speedup_model({"predicted": predicted, "predicted_before_calibration": predicted}, rows)
    fig.savefig(tmp_path / "s.png")
    curves, _before, full, quick, _baseline = fig.axes[0].lines
    assert list(curves.get_xdata()) == list(range(1, 17))
    assert (list(full.get_xdata()), list(quick.get_xdata())) == ([2], [16]) and quick.get_markerfacecolor() == "none"


def test_the_replay_script_predicts_a_recorded_cpu_run():
    """benchmarks/cost_model_replay.py on the recorded default run: every measured depth predicted by the model
    calibrated on the depths before it."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(
        "cost_model_replay", root / "benchmarks" / "questions" / "cost_model.py"
    )
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    out = replay.replay(root / "benchmarks/results/cost_model/cpu-epyc-avx2-2c-2026-12-01")
    assert out["plan"][0] == 1 and set(out["plan"]) == {1, 2, 5, 10, 16} and not out["not_measured"]
    assert len(out["rows"]) == 10 and sum(r["within"] for r in out["rows"]) >= 8
