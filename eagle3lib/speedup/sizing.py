"""The benchmark sized to the time the run has left (run.minutes): how many prompts every configuration
measures, chosen on the baseline's server before it measures anything, from what that server does on this machine.

`probe` times the running baseline server: its start (ready_s), one batch of `concurrency` short requests at each
level (seconds per decode step there) and the first long-context prompt's prefill. `fit` is pure: the most
question-set prompts (the sets taking turns, prompt_sets.take) such that every expected configuration, each with
its own server start, ends before the deadline; the long-context prompts (a side figure: the headline rests on the
sets) only when every question fits with them. Every configuration, the baseline included, measures the prompts chosen here.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

from eagle3lib.speedup import measurement, prompt_sets

PROBE_TOKENS = 16  # a probe request's tokens: enough steps to time a decode step, a few seconds on 2 cores
TAIL_S = 60.0  # after the sweep: the cost model's in-process timing, the replay and the report


@dataclass(frozen=True)
class Speeds:
    start_s: float  # the baseline server's start to healthy
    step_s: dict[int, float]  # concurrency -> seconds per decode step of a batch that full
    prefill_s_per_token: float  # the long-context prompt's prefill, per prompt token (0: none probed)


def probe(server, prompts: list[dict], concurrency: list[int]) -> Speeds:
    """What the running server takes here, measured with the sweep's own prompts (not measured as results)."""
    short = [p for p in prompts if p["set"] != prompt_sets.CONTEXT and p["prompt_ids"]]
    step_s = {}
    for c in sorted(set(concurrency)):
        batch = [short[i % len(short)] for i in range(c)]
        _, wall = measurement.run_requests(server, batch, PROBE_TOKENS, c)
        step_s[c] = wall / PROBE_TOKENS
    prefill = 0.0
    long_ = [p for p in prompts if p["set"] == prompt_sets.CONTEXT and p["prompt_ids"]]
    if long_:
        t0 = time.perf_counter()
        server.generate(long_[0]["prompt_ids"], 1)
        prefill = (time.perf_counter() - t0) / len(long_[0]["prompt_ids"])
    return Speeds(server.ready_s or 0.0, step_s, prefill)


def config_seconds(speeds: Speeds, prompts: list[dict], max_tokens: int, concurrency: list[int]) -> float:
    """One configuration's estimate on these prompts: its server's start, each concurrency's batches of
    max_tokens decode steps (the question sets; a later turn is one more request), the long-context prompts at the
    lowest concurrency. Speculation only shortens it."""
    questions = [p for p in prompts if p["set"] != prompt_sets.CONTEXT]
    seconds = speeds.start_s
    for c in concurrency:
        seconds += math.ceil(len(questions) / c) * max_tokens * speeds.step_s[c]
    low = speeds.step_s[min(concurrency)]
    for p in prompts:
        if p["set"] == prompt_sets.CONTEXT:
            seconds += len(p["prompt_ids"] or []) * speeds.prefill_s_per_token + max_tokens * low
    return seconds


TOOL_START_S = 20.0  # a serving benchmark's own start per load point (it imports its engine's package)


def load_seconds(speeds: Speeds, points, prompts: int, max_tokens: int) -> float:
    """One configuration's serving load (speedup/load.py) estimate: per point, the tool's start and its batches
    of max_tokens decode steps at the point's cap in flight, or the arrivals' span when that is longer."""
    seconds = 0.0
    for point in points:
        cap = point.concurrency or max(speeds.step_s)
        step = speeds.step_s.get(cap) or speeds.step_s[max(speeds.step_s)]
        busy = math.ceil(prompts / cap) * max_tokens * step
        seconds += TOOL_START_S + max(busy, prompts / point.rate if point.rate else 0.0)
    return seconds


@dataclass(frozen=True)
class Fit:
    """The prompts chosen to fit the stage's minutes, with the estimates and speeds they were chosen by."""

    prompts: list[dict]
    seconds_left: float
    configurations: int
    estimate_s: float  # the chosen prompts' estimate, every configuration
    asked_estimate_s: float  # every asked prompt's
    speeds: Speeds
    asked: int  # prompts asked (question and long-context)

    @property
    def sized(self) -> bool:
        return len(self.prompts) < self.asked

    def as_dict(self) -> dict:
        return {
            "prompts": len(self.prompts),
            "asked": self.asked,
            "seconds_left": round(self.seconds_left, 1),
            "configurations": self.configurations,
            "estimate_s": round(self.estimate_s, 1),
            "asked_estimate_s": round(self.asked_estimate_s, 1),
            "speeds": asdict(self.speeds),
        }

    def text(self) -> str:
        """The console's and the report's line: what the benchmark was sized to, and why."""
        step = self.speeds.step_s
        low = min(step)
        why = (
            f"{self.configurations} configuration(s), each a server start of {self.speeds.start_s:.0f} s and "
            f"{1 / step[low]:.1f} tokens/s at concurrency {low}"
        )
        if not self.sized:
            return (
                f"all {self.asked} prompts fit the run's time: about {self.asked_estimate_s / 60:.1f} of "
                f"{self.seconds_left / 60:.1f} min left ({why})"
            )
        over = " (the fewest that cover every set, still over it)" if self.estimate_s > self.seconds_left else ""
        return (
            f"sized to {len(self.prompts)} of {self.asked} prompts{over}: {self.asked} would take about "
            f"{self.asked_estimate_s / 60:.1f} min here, {self.seconds_left / 60:.1f} min are left of run.minutes "
            f"({why}); {len(self.prompts)} take about {self.estimate_s / 60:.1f} min"
        )


def fit(
    prompts: list[dict], speeds: Speeds, seconds_left: float, configurations: int, max_tokens: int,
    concurrency: list[int], load_s: float = 0.0,
) -> Fit:  # fmt: skip
    """Every prompt when their estimate, over `configurations` configurations (each also load_s of serving load)
    and TAIL_S, fits seconds_left; else the most question-set prompts that fit, without the long-context ones,
    and at least one first turn of every set (a later turn comes with its first)."""
    budget = seconds_left - TAIL_S - configurations * load_s

    def total(chosen):
        return configurations * config_seconds(speeds, chosen, max_tokens, concurrency)

    questions = [p for p in prompts if p["set"] != prompt_sets.CONTEXT]
    asked = total(prompts)
    fewest = len({p["set"] for p in questions})  # take's first ones: one first turn of every set
    if asked <= budget:
        chosen = prompts
    else:  # take keeps each set's order, so a later turn never comes without its first
        sizes = range(len(questions), fewest - 1, -1)
        chosen = next((t for n in sizes if total(t := prompt_sets.take(questions, n)) <= budget), None)
        chosen = chosen or prompt_sets.take(questions, fewest)
    order = {id(p): i for i, p in enumerate(prompts)}
    chosen = sorted(chosen, key=lambda p: order[id(p)])
    return Fit(chosen, seconds_left, configurations, total(chosen), asked, speeds, len(prompts))
