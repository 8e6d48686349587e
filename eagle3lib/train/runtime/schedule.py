"""The learning-rate schedule's length: the steps of train.max_tokens, or of train.max_minutes once the step rate is
known, whichever is fewer.

A cosine sized to the tokens and stopped by the clock ends at a high learning rate: it never anneals (a release
remake stopped by its minutes at 21% of its schedule was still at 0.91 of the peak). So with a time budget the schedule's
length is decided once, at the end of warmup: the median wall time of the steps so far (after the first, whose
compile is not a step's cost; the median, so that a recompile or an evaluation among them does not shorten the
schedule by its share of every step), plus an evaluation's time spread over eval_every steps, gives the steps the
rest of the budget holds. Steps a little slower than the median end the run a little before its schedule's end,
near the floor of the cosine; a schedule sized on an outlier would end it early and leave minutes unused.
The evaluation timed before the loop is a cold one (a compiled layer compiles again for evaluation, kernels load),
often ten times one in the loop: a schedule sized on it ends with much of the budget unused. So the decision is
revised once, at the first evaluation in the loop, from the mean of the steps since the decision and that
evaluation's time; early in the cosine, so the learning rate barely moves at the revision. The mean, not the median:
what recurs among those steps but not in each (the online capture's turns on the trainer's GPU, slow batches) is part
of every step's share of the budget, and a median leaves it out (the run then stops on the clock, its cosine unfinished).
The decision goes into the trainer state, so a resume with the same budgets keeps the same schedule (and still
revises one not yet revised); a resume with other budgets decides again from the recorded rate (a larger budget
continues the run, the cosine stretched). The clock still stops a run whose steps slow down later. Under data
parallelism rank 0 decides for every rank, and the ranks stop on the clock together.
"""

from __future__ import annotations

import math
import statistics

from eagle3lib.train.runtime.distributed import any_rank, rank0_value
from eagle3lib.train.runtime.optimizer import lr_at

MIN_TIMED_STEPS = 10  # steps timed before a decision, warmup shorter than that included
MARGIN = 0.97  # of the budget the schedule plans for: the final evaluation and checkpoint come after it


class Schedule:
    """Warmup then cosine over `total_steps`; `after_step` sizes total_steps to the time budget once, `over_time` is
    the clock's stop. state: the trainer state (its "schedule" entry is read and written here)."""

    def __init__(self, tp, tokens_per_step: int, state: dict, world: int, device):
        self.lr_peak, self.warmup, self.eval_every = tp.lr, tp.warmup_steps, tp.eval_every
        self.token_steps = max(1, math.ceil(tp.max_tokens / tokens_per_step))
        self.budget_s = (tp.max_minutes or 0) * 60  # 0: no time budget
        self.state, self.world, self.device = state, world, device
        self.total_steps, self.pending = self.token_steps, self.budget_s > 0
        self.revising = self.pending  # until an evaluation in the loop has been timed
        self.eval_s = None  # seconds of one evaluation, once one is timed
        self.first_step, self.last = None, None  # this process's first step; train seconds after the last one
        self.step_times = []  # seconds of each step after the first
        self.decided_index = 0  # step_times from this process's decision on (a resumed process: all of its own)
        made = state.get("schedule")
        if made and self.budget_s and made["token_steps"] == self.token_steps:
            self.revising = made.get("revised_at") is None
            if made["budget_s"] == self.budget_s:
                self.total_steps, self.pending = made["total_steps"], False
            else:  # another budget for the same run: the recorded rate sizes what is left of it
                self.eval_s = made.get("eval_s")
                self._set(state["step"], state["train_seconds"], made["step_s"], "resumed with another time budget")

    @property
    def key(self) -> dict:
        """What the schedule's length follows from, known before any step (BestKept keeps a best state per key)."""
        return {"token_steps": self.token_steps, "budget_s": self.budget_s}

    def lr(self, step: int) -> float:
        return lr_at(step, self.total_steps, self.lr_peak, self.warmup)

    def timed_eval(self, seconds: float, in_loop: bool) -> None:
        """An evaluation's seconds; in_loop: one among the steps (warm), not the one before them."""
        self.eval_s = seconds
        if in_loop and self.pending:  # the decision still to come uses a warm evaluation: nothing to revise
            self.revising = False

    def after_step(self, step: int, train_seconds: float) -> str | None:
        """Called after each step with the run's train seconds so far; returns what was decided, once."""
        if not (self.pending or self.revising):
            return None
        if self.first_step is None:
            self.first_step = step
        else:
            self.step_times.append(train_seconds - self.last)
        self.last = train_seconds
        if not self.pending or step < max(self.warmup, self.first_step + MIN_TIMED_STEPS):
            return None
        self.decided_index = len(self.step_times)
        return self._set(step, train_seconds, statistics.median(self.step_times), "decided", "median")

    def after_eval(self, step: int, train_seconds: float) -> str | None:
        """Called after each evaluation in the loop; at the first after the decision, the decision revised from
        the mean step since it and this evaluation's time (returns what was revised, once)."""
        since_decision = self.step_times[self.decided_index :]
        if self.pending or not self.revising or not since_decision:
            return None
        self.revising = False
        decided_at = self.state["schedule"]["decided_at"]
        why = self._set(step, train_seconds, statistics.fmean(since_decision), "revised", "mean")
        self.state["schedule"] |= {"decided_at": decided_at, "revised_at": step}
        return why

    def _set(self, step: int, train_seconds: float, step_s: float, how: str, rate: str = "recorded") -> str:
        per_step = step_s + (self.eval_s or 0.0) / max(1, self.eval_every)
        fit = int(max(0.0, self.budget_s * MARGIN - train_seconds) / max(per_step, 1e-9))
        # rank 0's decision for every rank: each measured its own clock
        total = rank0_value(min(self.token_steps, step + max(1, fit)), self.world, self.device)
        self.total_steps, self.pending = total, False
        bound = "train.max_tokens" if total == self.token_steps else "train.max_minutes"
        why = (
            f"schedule {how} at step {step}: {total} steps ({bound}); {step_s * 1000:.1f} ms a step ({rate})"
            + (f", evaluations {self.eval_s:.1f} s each every {self.eval_every}" if self.eval_s else "")
            + f", {self.budget_s - train_seconds:.0f} of {self.budget_s:.0f} s left"
        )
        self.state["schedule"] = {**self.key, "total_steps": total, "decided_at": step, "step_s": step_s,
                                  "eval_s": self.eval_s, "why": why}  # fmt: skip
        return why

    def over_time(self, train_seconds: float) -> bool:
        """Whether the time budget is spent; with several ranks, whether any rank's is (they stop on one step)."""
        if not self.budget_s:
            return False
        return any_rank(train_seconds > self.budget_s, self.world, self.device)
