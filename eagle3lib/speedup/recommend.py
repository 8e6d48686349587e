"""What the sweep's rows say: the fastest configuration per concurrency with its launch commands, and the rows as
display records."""

from __future__ import annotations

import shlex

from eagle3lib import engines
from eagle3lib.engines.schedule import DepthSchedule


def recommend(rows: list[dict], target_dir, drafts: dict) -> dict:
    """{concurrency: {config, depth, tokens_per_s, speedup, vllm, sglang}}: the fastest measured configuration
    per concurrency (the baseline included, so a depth that measured slower is never picked; depths run on
    fewer prompts than the baseline are left out) with ready-to-paste launch commands (drafts: engine -> its
    export folder)."""
    out = {}
    full = max((r.get("prompts", 0) for r in rows), default=0)
    for c in sorted({r["concurrency"] for r in rows}):
        best = max(
            (r for r in rows if r["concurrency"] == c and r.get("prompts", 0) == full), key=lambda r: r["tokens_per_s"]
        )
        d = best["depth"] or None
        out[str(c)] = {
            "config": best["config"],
            "depth": best["depth"],
            "tokens_per_s": round(best["tokens_per_s"], 1),
            "speedup": round(best["speedup"], 3),
            "accept_len": best.get("accept_len"),
            **{
                e: shlex.join(engines.launch_command(e, target_dir, drafts.get(e, f"<{e} export>"), d, "python"))
                for e in ("vllm", "sglang")
            },
        }
    return out


def figure_text(x, digits=2):
    return "–" if x is None else f"{x:.{digits}f}"


def table(rows: list[dict]) -> list[dict]:
    """Rows as display records (rounded; per-position acceptance as text)."""
    return [
        {
            "config": r["config"],
            "depth": r["depth"],
            "concurrency": r["concurrency"],
            "tokens/s": round(r["tokens_per_s"], 1),
            "ms/token": round(r["tpot_ms"], 1),
            "ITL p90 ms": figure_text(r.get("p90_itl_ms"), 1),  # under load (speedup/load.py), when measured
            "TTFT p90 ms": figure_text(r.get("p90_ttft_ms"), 0),
            "speedup": round(r["speedup"], 2),
            "predicted speedup": figure_text(r.get("predicted_speedup"))
            + (" (calibrates)" if r.get("calibration") else ""),
            "prompts": r.get("prompts", "–"),
            "accept len": figure_text(r.get("accept_len")),
            "predicted": figure_text(r.get("predicted_accept_len")),
            "per position": " ".join(f"{x:.2f}" for x in r.get("per_pos") or []),
            "lossless": "sampled" if r["lossless_frac"] is None else f"{r['lossless_frac']:.0%}",
            "efficiency": figure_text(r.get("efficiency")),
        }
        for r in rows
    ]


def schedule_launch(schedule: dict | None, target_dir, drafts: dict, folder) -> dict | None:
    """The depth schedule the sweep derived (sweep.Sweep.deploy_schedule's record), as ready-to-paste launch
    commands: vLLM's carries it in --speculative-config, SGLang's in an adaptive config file written into folder."""
    if not schedule:
        return None
    chosen = DepthSchedule.from_json(schedule["schedule"])
    return {
        "schedule": chosen.as_json(),
        "text": chosen.text(),
        **{
            e: shlex.join(
                engines.launch_command(e, target_dir, drafts.get(e, f"<{e} export>"), chosen, "python", folder)
            )
            for e in ("vllm", "sglang")
        },
    }
