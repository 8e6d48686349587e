"""The learning-rate schedule's length under a time budget (train/runtime/schedule.py): decided once from the measured
step rate, revised once at the first evaluation in the loop, kept across a resume with the same budgets, decided
again for another budget."""

from types import SimpleNamespace

import pytest

from eagle3lib.train.runtime.schedule import Schedule


def params(**kw):
    tp = {"lr": 1e-3, "warmup_steps": 5, "eval_every": 10, "max_tokens": 1000 * 100, "max_minutes": 1.0} | kw
    return SimpleNamespace(**tp)


def run_steps(schedule, until: int, step_s: float = 1.0, first_s: float = 4.0):
    """after_step for steps 1..until, the first one slower (its compile), each later one step_s; what was decided."""
    decided = []
    for step in range(1, until + 1):
        why = schedule.after_step(step, first_s + (step - 1) * step_s)
        if why:
            decided.append((step, why))
    return decided


def test_without_a_time_budget_the_tokens_size_the_schedule():
    state = {"step": 0, "train_seconds": 0.0}
    s = Schedule(params(max_minutes=None), 1000, state, 1, "cpu")
    assert s.total_steps == 100 and run_steps(s, 30) == [] and "schedule" not in state
    assert s.lr(100) == pytest.approx(1e-4)  # annealed at the tokens' end


def test_the_minutes_size_the_schedule_once_at_the_end_of_the_timed_steps():
    state = {"step": 0, "train_seconds": 0.0}
    s = Schedule(params(), 1000, state, 1, "cpu")
    s.timed_eval(2.0, in_loop=False)  # an evaluation: 0.2 s a step over eval_every 10
    decided = run_steps(s, 40)
    # timed from step 1 (after the compile) to step 11: 1 s a step; 60 s x 0.97 - 14 s used, at 1.2 s a step: 36 more
    assert [step for step, _ in decided] == [11]
    assert s.total_steps == 11 + 36 and "train.max_minutes" in decided[0][1]
    assert state["schedule"]["total_steps"] == 47 and state["schedule"]["step_s"] == pytest.approx(1.0)
    assert s.lr(47) == pytest.approx(1e-4) and s.lr(20) > 5e-4  # it anneals by the budget's end


def test_the_tokens_bind_where_they_end_first():
    state = {"step": 0, "train_seconds": 0.0}
    s = Schedule(params(max_tokens=1000 * 20), 1000, state, 1, "cpu")
    decided = run_steps(s, 15)
    assert s.total_steps == 20 and "train.max_tokens" in decided[0][1]


def test_a_resume_keeps_the_decided_schedule_and_another_budget_decides_again():
    state = {"step": 0, "train_seconds": 0.0}
    s = Schedule(params(), 1000, state, 1, "cpu")
    run_steps(s, 11)
    state |= {"step": 30, "train_seconds": 33.0}  # as a checkpoint at step 30 holds it
    again = Schedule(params(), 1000, dict(state), 1, "cpu")
    assert again.total_steps == s.total_steps and run_steps(again, 40) == []
    more = Schedule(params(max_minutes=2.0), 1000, state, 1, "cpu")  # the tokens' 100 steps bind at 1.2 s a step:
    assert more.total_steps == 100 and state["schedule"]["budget_s"] == 120.0
    tighter = Schedule(params(max_minutes=1.5), 1000, state, 1, "cpu")  # the recorded 1 s a step (no eval timed)
    assert tighter.total_steps == 30 + int(90 * 0.97 - 33.0) and state["schedule"]["budget_s"] == 90.0
    other_tokens = Schedule(params(max_tokens=1000 * 500), 1000, dict(state), 1, "cpu")
    assert other_tokens.total_steps == 500 and other_tokens.pending  # another run's record: decided afresh


def test_the_clock_stops_past_the_budget_only():
    s = Schedule(params(), 1000, {"step": 0, "train_seconds": 0.0}, 1, "cpu")
    assert not s.over_time(59.9) and s.over_time(60.1)
    assert not Schedule(params(max_minutes=None), 1000, {"step": 0}, 1, "cpu").over_time(1e9)


def test_a_slow_step_among_the_timed_ones_does_not_shorten_the_schedule():
    """A recompile (or an evaluation) inside the timed steps: the median step sizes the schedule, so it loses only
    that step's seconds from the budget, not its share of every step."""
    state = {"step": 0, "train_seconds": 0.0}
    s = Schedule(params(), 1000, state, 1, "cpu")
    clock = 4.0
    for step in range(1, 12):
        clock += 20.0 if step == 6 else (1.0 if step > 1 else 0.0)
        s.after_step(step, clock)
    # 4 s for the first step, 9 of 1 s and one of 20: 33 s used, 60 x 0.97 - 33 = 25.2 s left at the median 1 s a step
    assert state["schedule"]["step_s"] == pytest.approx(1.0) and s.total_steps == 11 + 25


def test_a_cold_first_evaluation_is_revised_at_the_first_warm_one():
    """The evaluation before the loop compiles and loads (ten times one in the loop on an H100): sized on it, the schedule
    ends with the budget half used. The first evaluation in the loop revises it, once; a resume keeps the revision."""
    state = {"step": 0, "train_seconds": 0.0}
    s = Schedule(params(), 1000, state, 1, "cpu")
    s.timed_eval(20.0, in_loop=False)  # cold: 2 s a step over eval_every 10
    run_steps(s, 11)
    assert s.total_steps == 11 + int((60 * 0.97 - 14.0) / 3.0)  # 25 steps: the run would end at ~40 of 60 s
    s.timed_eval(1.0, in_loop=True)  # the evaluation at step 20, warm
    clock = 4.0 + 19 * 1.0
    assert [s.after_step(step, 4.0 + (step - 1) * 1.0) for step in range(12, 21)] == [None] * 9
    why = s.after_eval(20, clock)
    assert why.startswith("schedule revised at step 20") and state["schedule"]["revised_at"] == 20
    assert s.total_steps == 20 + int((60 * 0.97 - clock) / 1.1)  # 1 s a step (median), 0.1 s of evaluation each
    assert s.after_eval(30, clock + 10) is None  # once
    kept = Schedule(params(), 1000, dict(state), 1, "cpu")
    assert kept.total_steps == s.total_steps and kept.after_eval(30, 33.0) is None
    before = {"step": 15, "train_seconds": 18.0, "schedule": {**state["schedule"], "revised_at": None}}
    resumed = Schedule(params(), 1000, before, 1, "cpu")  # a checkpoint between the decision and the revision
    for step in range(16, 21):
        resumed.after_step(step, 18.0 + (step - 15) * 1.0)
    assert resumed.after_eval(20, 23.0).startswith("schedule revised") and before["schedule"]["revised_at"] == 20


def test_a_warm_evaluation_before_the_decision_leaves_nothing_to_revise():
    state = {"step": 0, "train_seconds": 0.0}
    s = Schedule(params(warmup_steps=12), 1000, state, 1, "cpu")
    s.timed_eval(20.0, in_loop=False)
    run_steps(s, 10)
    s.timed_eval(1.0, in_loop=True)  # at step 10, before the decision at 12
    run_steps_from = [s.after_step(step, 4.0 + (step - 1) * 1.0) for step in (11, 12)]
    assert run_steps_from[1].startswith("schedule decided at step 12") and s.after_eval(20, 23.0) is None
    assert s.total_steps == 12 + int((60 * 0.97 - 15.0) / 1.1)


def test_the_revision_counts_what_recurs_among_the_steps():
    """The online capture takes turns on the trainer's GPU: every third step waits 4 s for it, the others take 1 s.
    The median step (1 s) would plan twice the steps the budget holds and the clock would stop the cosine halfway;
    the mean since the decision (2 s) plans a schedule that ends, annealed, inside the budget."""
    state = {"step": 0, "train_seconds": 0.0}
    s = Schedule(params(max_minutes=2.0), 1000, state, 1, "cpu")
    s.timed_eval(20.0, in_loop=False)

    def seconds(step):  # of step `step` (the first one compiles)
        return 4.0 if step == 1 or step % 3 == 0 else 1.0

    clock, step, why = 0.0, 0, None
    while step < s.total_steps and not s.over_time(clock):
        step += 1
        clock += seconds(step)
        if step == 20:
            s.timed_eval(0.5, in_loop=True)
            clock += 0.5
            why = s.after_eval(step, clock) or why
        s.after_step(step, clock)
    assert why.startswith("schedule revised at step 20") and "ms a step (mean)" in why
    assert state["schedule"]["step_s"] == pytest.approx(2.0, abs=0.2)
    assert step == s.total_steps and not s.over_time(clock)  # the schedule ended, not the clock
    assert 120 * 0.85 < clock <= 120 and s.lr(step) == pytest.approx(1e-4)  # the budget used, the cosine annealed
