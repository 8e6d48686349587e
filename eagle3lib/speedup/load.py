"""Serving load on each configuration's server: the engine's own serving benchmark (engines/serving_bench.py) at
every load point, after the sweep's own measurements on that server, for the latency figures a serving engineer
holds against an SLO (time to first token, inter-token latency p50/p90/p99) beside output tokens/s.

Load points: closed loop at each bench.concurrency (that many requests in flight, the batch sizes the depth
schedule is chosen at), then Poisson arrivals at each bench.load_rates, capped at the highest concurrency. Each
point sends the same bench.load_prompts first-turn prompts (their chat-rendered text), bench.max_tokens each.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3lib import engines
from eagle3lib.engines.serving_bench import LoadPoint
from eagle3lib.speedup import prompt_sets, sizing


def load_points(bench) -> list[LoadPoint]:
    """Closed loop at each bench.concurrency, then each bench.load_rates capped at the highest concurrency."""
    cap = max(bench.concurrency)
    return [LoadPoint(None, c) for c in sorted(set(bench.concurrency))] + [LoadPoint(r, cap) for r in bench.load_rates]


def load_texts(prompts: list[dict], decode, n: int) -> list[str]:
    """The first n question-set first turns (sets taking turns), as text: decode(prompt_ids)."""
    firsts = [p for p in prompts if p["set"] != prompt_sets.CONTEXT and p.get("turn", 1) == 1 and p["prompt_ids"]]
    return [decode(p["prompt_ids"]) for p in prompt_sets.take(firsts, n)]


@dataclass
class LoadSweep:
    """The load points every configuration serves, the texts sent, and where the tool runs and writes."""

    points: list[LoadPoint]
    texts: list[str]
    max_tokens: int
    engine_params: object
    target_dir: str
    folder: Path
    timeout_s: float = 1800.0

    def seconds(self, speeds) -> float:
        """One configuration's estimate on a server that runs at `speeds` (speedup/sizing.py)."""
        return sizing.load_seconds(speeds, self.points, len(self.texts), self.max_tokens)

    def measure(self, server, config: str, schedule) -> list[dict]:
        """Each load point on the running server: one row each, named by the configuration (schedule: its
        as_json(), or None for a fixed depth)."""
        bench = server.serving_bench
        python = engines.python_for(self.engine_params)
        rows = []
        for point in self.points:
            got = bench.run(
                python, server, self.target_dir, self.texts, self.max_tokens, point, self.folder, self.timeout_s
            )
            rows.append({"config": config, "schedule": schedule, **point.as_dict(), "load": point.name(), **got})
        return rows


def latency_at(load_rows: list[dict], config: str, concurrency: int) -> dict:
    """The closed-loop load row of `config` at `concurrency`, or {} when none was measured."""
    return next(
        (r for r in load_rows if r["config"] == config and r["rate"] is None and r["concurrency"] == concurrency), {}
    )


def for_params(p, prompts: list[dict], tokenizer, target_dir, out) -> LoadSweep | None:
    """The serving load every configuration serves (bench.load_prompts first turns at each load point, files in
    out/load), or None when bench.load_prompts is 0."""
    if not p.bench.load_prompts:
        return None
    texts = load_texts(prompts, tokenizer.decode, p.bench.load_prompts)
    return LoadSweep(load_points(p.bench), texts, p.bench.max_tokens, p.engine, str(target_dir), Path(out) / "load")
