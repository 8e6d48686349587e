"""The depth that pays at each load, from the sweep's measurements: a DepthSchedule the engines take
(engines/schedule.py) and the reason for each of its steps.

At each measured concurrency (the batch size the server runs at that load), the fixed configurations measured on
every prompt compete (no speculation is depth 0): the fastest in output tokens/s wins, or, given a latency target
(bench.slo_itl_p90_ms), the fastest of those whose p90 inter-token latency meets it; where none meets it, the one
closest to it, and the choice says so. The measured concurrencies become the schedule's steps: a batch size uses
the choice at the largest measured concurrency not above it (how SGLang routes a batch to its adaptive config's
keys, and how vLLM's ranges are written). Measurements choose; the cost model only chose what to measure.
"""

from __future__ import annotations

from eagle3lib.engines.schedule import DepthSchedule


def fixed_rows(rows: list[dict]) -> list[dict]:
    """The rows of fixed configurations (the baseline and single depths) measured on every prompt."""
    full = max((r.get("prompts", 0) for r in rows), default=0)
    return [r for r in rows if not r.get("schedule") and r.get("prompts", 0) == full]


def choose(rows: list[dict], concurrency: int, itl_p90_ms: float | None = None) -> dict:
    """{concurrency, depth, config, tokens_per_s, p90_itl_ms, meets_target, why}: the configuration to run at
    `concurrency` (see the module's docstring). rows: the sweep's rows, each with depth, config, concurrency,
    tokens_per_s and, under load, p90_itl_ms."""
    here = [r for r in fixed_rows(rows) if r["concurrency"] == concurrency]
    if not here:
        raise ValueError(f"no configuration was measured on every prompt at concurrency {concurrency}")
    fastest = max(here, key=lambda r: r["tokens_per_s"])
    meets, why = None, f"the most output tokens/s of {len(here)} configurations"
    if itl_p90_ms is not None:
        timed = [r for r in here if r.get("p90_itl_ms") is not None]
        if not timed:
            why += f"; no p90 inter-token latency was measured here to hold against {itl_p90_ms:g} ms"
        else:
            within = [r for r in timed if r["p90_itl_ms"] <= itl_p90_ms]
            meets = bool(within)
            if within:
                fastest = max(within, key=lambda r: r["tokens_per_s"])
                why = f"the most output tokens/s of the {len(within)} with p90 inter-token latency <= {itl_p90_ms:g} ms"
            else:
                fastest = min(timed, key=lambda r: r["p90_itl_ms"])
                why = f"no configuration meets p90 inter-token latency <= {itl_p90_ms:g} ms here: the lowest latency"
    return {
        "concurrency": concurrency,
        "depth": fastest["depth"],
        "config": fastest["config"],
        "tokens_per_s": fastest["tokens_per_s"],
        "p90_itl_ms": fastest.get("p90_itl_ms"),
        "meets_target": meets,
        "why": why,
    }


def derive(rows: list[dict], itl_p90_ms: float | None = None) -> dict:
    """{schedule: DepthSchedule, steps: [choose()'s record per measured concurrency]}; consecutive concurrencies
    with one depth make one step, and the first step starts at batch size 1."""
    concurrencies = sorted({r["concurrency"] for r in fixed_rows(rows)})
    if not concurrencies:
        raise ValueError("no measured rows to derive a depth schedule from")
    choices = [choose(rows, c, itl_p90_ms) for c in concurrencies]
    steps: list[tuple[int, int]] = []
    for i, c in enumerate(choices):
        if not steps or steps[-1][1] != c["depth"]:
            steps.append((1 if i == 0 else c["concurrency"], c["depth"]))
    return {"schedule": DepthSchedule(tuple(steps)), "steps": choices}
