"""The 05_benchmark stage's texts and result, from the sweep (sweep.benchmark), its recommendation
(sweep.recommend) and the replay (replay.replay_prompts); the cost model's in-process probe."""

from __future__ import annotations

import os

import torch

from eagle3lib import engines
from eagle3lib.bench import cost

ARTIFACTS = [
    "speedup_vs_depth.png",
    "throughput_vs_depth.png",
    "acceptance_vs_depth.png",
    "per_position.png",
    "provenance.json",
]
SWEEP_FIGURES = (
    "differences",
    "lossless_reference",
    "dtype",
    "baseline_agreement_across_concurrency",
    "restart_per_configuration",
)


def cost_probe(p, target_name_or_dir: str, cache_dir, drafter_dir, prompts: list[dict]):
    """The callable sweep.benchmark runs after the baseline: the target and the trained drafter loaded here in
    the engine's dtype and timed by bench.cost.forward_costs over the token counts the cost model reads (c
    sequences verifying 1..max_depth+1 tokens), after a context of the bench's typical length; then freed."""

    def measure():
        from eagle3lib import target
        from eagle3lib.bench import cost
        from eagle3lib.train import checkpoint

        dtype = p.bench.dtype or p.target.dtype
        model, _ = target.load_target(
            target_name_or_dir,
            cache_dir,
            dtype=dtype,
            device=p.target.device,
            trust_remote_code=p.target.trust_remote_code,
        )
        drafter = checkpoint.load_drafter(drafter_dir, device=p.target.device).to(target.torch_dtype(dtype)).eval()
        context = sum(len(x["prompt_ids"]) for x in prompts) // len(prompts) + p.bench.max_tokens // 2
        chain = [k for k in (1, 2, 3, 4, 6, 9, 17) if k <= p.bench.max_depth + 1] + [p.bench.max_depth + 1]
        tokens = sorted({c * k for c in p.bench.concurrency for k in chain} | {1})
        threads = torch.get_num_threads()
        if p.target.device == "cpu" and p.engine.name == "vllm":
            torch.set_num_threads(engines.vllm.cpu_worker_threads({**os.environ, **p.engine.env}))  # as the engine
        try:
            return cost.forward_costs(model, drafter, context, tokens)
        finally:
            torch.set_num_threads(threads)
            del model, drafter
            torch.cuda.empty_cache() if torch.cuda.is_available() else None

    return measure


def replay_depths(swept: dict, bench_params) -> list[int]:
    """The depths to replay: the user's (bench.depths), the cost model's picks and the fastest measured depth
    (the headline's)."""
    picks = (swept.get("cost_model") or {}).get("picks", {})
    best = best_speculative(swept["rows"])
    return sorted(set(bench_params.depths) | set(picks.values()) | ({best["depth"]} if best else set()))


def lossless_headline(swept: dict) -> str:
    """The worst share of speculative outputs equal to the baseline's at the same concurrency, set beside the
    share on which the baseline agrees with itself across concurrency when the engine ran in bf16: there a
    batch's kernels round differently, so the baseline is the bar, not 100%."""
    rows = [r for r in swept["rows"] if r["depth"]]
    worst = min((r["lossless_frac"] for r in rows), default=1.0)
    agree = swept.get("baseline_agreement_across_concurrency")
    if swept.get("dtype") == "float32" or agree is None or agree == 1.0 or worst == 1.0:
        return f"{worst:.0%}" + (" (fp32, token for token)" if swept.get("dtype") == "float32" else "")
    return f"{worst:.0%}, as exact as the baseline across batch sizes ({agree:.0%}); fp32 checks it token for token"


def losslessness_text(swept: dict) -> str:
    """What the speculative outputs were compared with and every difference from it, none hidden."""
    lines = [
        f"reference: {swept['lossless_reference']}",
        f"baseline agreement across concurrency: {swept['baseline_agreement_across_concurrency']}",
        f"headline: {lossless_headline(swept)}",
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


def speedup_limits(swept: dict, target_speedup: float = 1.5) -> list[dict]:
    """bench.cost.limits of the fastest speculative row at each concurrency, measured on every prompt where
    there is one; the step split only where the cost model timed the target and drafter in process."""
    model = swept.get("cost_model")
    if model:
        costs = cost.Costs(**{k: _int_keys(v) if isinstance(v, dict) and k != "calibrated_on" else v
                              for k, v in model["costs"].items()})  # fmt: skip
    else:
        decode, share = cost.decode_costs([r for r in swept["rows"] if r["depth"] == 0])
        costs = cost.Costs(decode, {}, {}, share)
    full = max((r.get("prompts", 0) for r in swept["rows"]), default=0)
    out = []
    for c in sorted({r["concurrency"] for r in swept["rows"]}):
        spec = [r for r in swept["rows"] if r["depth"] and r["concurrency"] == c and r.get("accept_len")]
        spec = [r for r in spec if r.get("prompts", 0) == full] or spec
        if spec and c in costs.decode_ms:
            out.append(cost.limits(costs, max(spec, key=lambda r: r["speedup"]), target_speedup))
    return out


def limits_text(limits: list[dict]) -> str:
    """Each concurrency's fastest depth: what its step costs, what full acceptance would give, what it lacks."""
    lines = []
    for x in limits:
        needed = x["accept_len_needed"]
        lines.append(
            f"concurrency {x['concurrency']}, depth {x['depth']}: {x['speedup']:.2f}x at acceptance length "
            f"{x['accept_len']:.2f}. A speculative step costs {x['step_decode_steps']:.2f} decode steps "
            + (
                f"(verify {x['verify_decode_steps']:.2f} + drafts {x['drafts_decode_steps']:.2f} + engine "
                f"{x['engine_decode_steps']:+.2f})"
                if x["verify_decode_steps"] is not None
                else "(not split: no cost model in this sweep)"
            )
            + f"; prefill is {x['prefill_share']:.0%} of the baseline's time.\n"
            f"  With every draft accepted (acceptance length {x['depth'] + 1}) this step would give "
            f"{x['all_accepted_speedup']:.2f}x; {x['target_speedup']}x needs acceptance length "
            + ("out of reach (prefill)" if needed is None else f"{needed:.2f}")
            + f" at this step. Limited by {x['limited_by']}."
        )
    return "\n".join(lines) or "no speculative measurement with the cost model"


def _int_keys(d: dict) -> dict:
    """A JSON-read {concurrency or token count: value} with its keys back as ints."""
    return {int(k): v for k, v in d.items()}


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
        "cost_model": swept.get("cost_model"),
        "limits": speedup_limits(swept),
    }
    best = best_speculative(rows)
    headline = {
        "best speedup": best and f"{best['speedup']:.2f}x ({best['config']}, concurrency {best['concurrency']})",
        "acceptance length": best and _round(best["accept_len"], 2),
        "replay acceptance": best and _round(replayed["summary"].get(str(best["depth"]), {}).get("accept_len"), 2),
        "lossless": lossless_headline(swept),
    }
    if swept.get("cost_model"):
        picks = swept["cost_model"]["picks"]
        headline["cost model picks"] = ", ".join(f"{d} at concurrency {c}" for c, d in picks.items())
    return {"figures": figures, "headline": headline, "artifacts": ARTIFACTS}
