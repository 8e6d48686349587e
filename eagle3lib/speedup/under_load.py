"""What the serving load says (speedup/load.py's rows): latency per configuration and load, and the deployed depth
schedule against the best fixed configuration and the baseline at every load point."""

from __future__ import annotations

from eagle3lib.speedup.recommend import figure_text

SCHEDULE_FLOOR = 0.97  # the schedule should serve at least this share of the best fixed configuration at each load


def table(load_rows: list[dict]) -> list[dict]:
    """The load rows as display records: output tokens/s, time to first token and inter-token latency percentiles."""
    return [
        {
            "config": r["config"],
            "load": r["load"],
            "tokens/s": round(r["tokens_per_s"], 1),
            "TTFT p50/p90/p99 ms": " / ".join(figure_text(r.get(f"p{p}_ttft_ms"), 0) for p in (50, 90, 99)),
            "ITL p50/p90/p99 ms": " / ".join(figure_text(r.get(f"p{p}_itl_ms"), 1) for p in (50, 90, 99)),
            "requests": r["completed"],
        }
        for r in load_rows
    ]


def latency_headline(rows: list[dict], recommendation: dict) -> str:
    """'1 in flight: depth3 31.2 ms (baseline 40.1), ...': the recommended configuration's p90 inter-token latency
    beside the baseline's at each concurrency."""
    parts = []
    for c, rec in recommendation.items():
        here = {r["config"]: r.get("p90_itl_ms") for r in rows if str(r["concurrency"]) == c}
        base = next((v for k, v in here.items() if k.startswith("baseline")), None)
        parts.append(f"{c} in flight: {rec['config']} {figure_text(here.get(rec['config']), 1)} ms (baseline "
                     f"{figure_text(base, 1)})")  # fmt: skip
    return ", ".join(parts)


def _point(r: dict) -> tuple:
    return (r["rate"] is not None, r["rate"] or 0.0, r["concurrency"] or 0)


def schedule_against_fixed(load_rows: list[dict]) -> dict | None:
    """Per load point, the schedule's tokens/s beside the best fixed configuration's and the baseline's, and over
    the sweep each configuration's mean; None without a schedule's rows. `holds` is the goal the schedule is held
    to: >= SCHEDULE_FLOOR x the best fixed at every point, and a mean at least every fixed configuration's."""
    scheduled = [r for r in load_rows if r.get("schedule")]
    if not scheduled:
        return None
    fixed = [r for r in load_rows if not r.get("schedule")]
    points = []
    for s in sorted(scheduled, key=_point):
        here = [r for r in fixed if _point(r) == _point(s)]
        if not here:
            continue
        best = max(here, key=lambda r: r["tokens_per_s"])
        base = next((r for r in here if r["config"].startswith("baseline")), None)
        points.append(
            {
                "load": s["load"],
                "schedule": s["tokens_per_s"],
                "best_fixed": best["config"],
                "best_fixed_tokens_per_s": best["tokens_per_s"],
                "against_best": s["tokens_per_s"] / best["tokens_per_s"],
                "against_baseline": s["tokens_per_s"] / base["tokens_per_s"] if base else None,
                "itl_p90_ms": s.get("p90_itl_ms"),
            }
        )
    keys = {_point(s) for s in scheduled}
    means = {}
    for r in fixed + scheduled:
        if _point(r) in keys:
            means.setdefault("schedule" if r.get("schedule") else r["config"], []).append(r["tokens_per_s"])
    means = {k: sum(v) / len(v) for k, v in means.items() if len(v) == len(keys)}
    short = [p["load"] for p in points if p["against_best"] < SCHEDULE_FLOOR]
    beaten = [k for k, v in means.items() if k != "schedule" and v > means.get("schedule", 0)]
    return {"points": points, "means": means, "short_at": short, "mean_beaten_by": beaten,
            "holds": not short and not beaten}  # fmt: skip


def schedule_text(schedule: dict | None, against: dict | None) -> str:
    """The derived schedule, why each step, whether it was deployed, and how it served against the fixed ones."""
    if not schedule:
        return "no depth schedule (bench.schedule is off)"
    lines = [f"depth schedule: {schedule['text']}"]
    for s in schedule["steps"]:
        lines.append(f"  at {s['concurrency']} in flight: {s['config']} ({s['tokens_per_s']:.1f} tokens/s), {s['why']}")
    if schedule.get("refused"):
        lines.append(f"the engine did not serve it: {schedule['refused']}")
    elif not schedule["deployed"]:
        lines.append(schedule.get("why_not_deployed", "not deployed"))
    if against:
        for p in against["points"]:
            lines.append(
                f"  {p['load']}: {p['schedule']:.1f} tokens/s, {p['against_best']:.2f}x the best fixed "
                f"({p['best_fixed']}), " + f"{figure_text(p['against_baseline'])}x the baseline"
            )
        means = ", ".join(f"{k} {v:.1f}" for k, v in sorted(against["means"].items(), key=lambda kv: -kv[1]))
        lines.append(f"  mean tokens/s over the load points: {means}")
        if against["short_at"]:
            lines.append(f"  below {SCHEDULE_FLOOR}x the best fixed configuration at: {', '.join(against['short_at'])}")
        if against["mean_beaten_by"]:
            lines.append(f"  a fixed configuration serves more on the mean: {', '.join(against['mean_beaten_by'])}")
    return "\n".join(lines)
