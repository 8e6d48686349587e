"""The 05_benchmark stage's texts and result, from the sweep (sweep.benchmark), its recommendation
(sweep.recommend) and the replay (replay.replay_prompts)."""

from __future__ import annotations

ARTIFACTS = ["throughput_vs_depth.png", "acceptance_vs_depth.png", "per_position.png", "provenance.json"]
SWEEP_FIGURES = (
    "differences",
    "lossless_reference",
    "dtype",
    "baseline_agreement_across_concurrency",
    "restart_per_configuration",
)


def losslessness_text(swept: dict) -> str:
    """What the speculative outputs were compared with and every difference from it, none hidden."""
    lines = [
        f"reference: {swept['lossless_reference']}",
        f"baseline agreement across concurrency: {swept['baseline_agreement_across_concurrency']}",
    ]
    for d in swept["differences"]:
        lines.append(
            f"- {d['id']} depth {d['depth']} concurrency {d['concurrency']}: first different token {d['first_diff']}\n"
            f"    baseline:    {d['baseline']!r}\n    speculative: {d['speculative']!r}"
        )
    if not swept["differences"]:
        lines.append("every speculative output equals the baseline's, token for token")
    return "\n".join(lines)


def recommendation_text(recommendation: dict) -> str:
    """The fastest configuration per concurrency with its launch commands."""
    return "\n".join(
        f"concurrency {c}: {r['config']} at {r['tokens_per_s']} tokens/s ({r['speedup']}x the baseline)\n"
        f"  vLLM:   {r['vllm']}\n  SGLang: {r['sglang']}\n"
        for c, r in recommendation.items()
    )


def best_speculative(rows: list[dict]) -> dict | None:
    """The speculative row with the highest speedup over the baseline, None without speculative rows."""
    spec = [r for r in rows if r["depth"]]
    return max(spec, key=lambda r: r["speedup"]) if spec else None


def _round(x, digits):
    return x and round(x, digits)  # None (and 0) as they are


def result(swept: dict, recommendation: dict, replayed: dict, prompts: int, max_tokens: int) -> dict:
    """For Stage.save: the sweep's rows, recommendation, losslessness and the replay's summary as figures;
    the best speedup, its acceptance length (engine and replay) and the worst losslessness as the headline."""
    rows = swept["rows"]
    figures = {
        "rows": rows,
        "recommendation": recommendation,
        **{k: swept[k] for k in SWEEP_FIGURES},
        "sweep_seconds": swept["seconds"],
        "prompts": prompts,
        "max_tokens": max_tokens,
        "logs": sorted({r["log"] for r in rows}),
        "replay": {"target_dtype": replayed["target_dtype"], "summary": replayed["summary"]},
    }
    best = best_speculative(rows)
    headline = {
        "best speedup": best and f"{best['speedup']:.2f}x ({best['config']}, concurrency {best['concurrency']})",
        "acceptance length": best and _round(best["accept_len"], 2),
        "replay acceptance": best and _round(replayed["summary"][str(best["depth"])]["accept_len"], 2),
        "lossless": f"{min(r['lossless_frac'] for r in rows):.0%}",
    }
    return {"figures": figures, "headline": headline, "artifacts": ARTIFACTS}
