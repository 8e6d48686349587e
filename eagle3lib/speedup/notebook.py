"""The 05_benchmark stage's texts and result, from the sweep (sweep.benchmark), its recommendation
(fastest.recommend) and the replay (replay.replay_prompts); the cost model's in-process probe."""

from __future__ import annotations

import os

import torch

from eagle3lib import engines
from eagle3lib.speedup import cost, per_set, prompt_sets, sampling, under_load

ARTIFACTS = [
    "speedup_vs_depth.png",
    "throughput_vs_depth.png",
    "acceptance_vs_depth.png",
    "per_position.png",
    "acceptance_vs_context.png",
    "load.png",
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
        from eagle3lib.speedup import cost
        from eagle3lib.train.runtime import checkpoint

        dtype = p.bench.dtype or p.target.dtype
        model, _ = target.load_target(
            target_name_or_dir,
            cache_dir,
            dtype=dtype,
            device=p.target.device,
            trust_remote_code=p.target.trust_remote_code,
        )
        drafter = checkpoint.load_drafter(drafter_dir, device=p.target.device).to(target.torch_dtype(dtype)).eval()
        typical = [x for x in prompts if x["set"] != "context" and x["prompt_ids"]]
        context = sum(len(x["prompt_ids"]) for x in typical) // len(typical) + p.bench.max_tokens // 2
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


def bench_prompts(p, tokenizer, held_out: list[dict]) -> list[dict]:
    """bench.prompts' sets (every entry checked before anything runs) and bench.context_lengths' long prompts,
    rendered through the target's chat template. Long prompts that would not fit the target's context with
    bench.max_tokens to generate are refused here, not by the engine mid-sweep."""
    from pathlib import Path

    base_dir = Path(p.file).parent if p.file else None
    prompt_sets.check_entries(p.bench.prompts, base_dir)
    render = prompt_sets.renderer(tokenizer)
    prompts = prompt_sets.build_prompts(render, p.bench.prompts, p.bench.num_prompts, held_out, base_dir)
    prompts += prompt_sets.context_prompts(render, held_out, p.bench.context_lengths, p.bench.context_prompts)
    return prompts


def check_context(prompts: list[dict], target_config, max_tokens: int, engine_params=None) -> list[dict]:
    """The prompts that fit, with bench.max_tokens to generate, within the context the engine serves: the
    target's max_position_embeddings, or less where engine.extra_args limit it (--max-model-len,
    --context-length). A question-set prompt that does not fit is left out, for every configuration alike, with
    a line; a long-context prompt (bench.context_lengths) that does not fit is refused, since it was asked for."""
    from eagle3lib import target

    limits = {"the target's context": getattr(target.text_config(target_config), "max_position_embeddings", None)}
    if engine_params is not None:
        limits[f"{engine_params.name}'s context (engine.extra_args)"] = engines.context_limit(engine_params)
    limits = {why: n for why, n in limits.items() if n}
    if not limits:
        return prompts
    why, limit = min(limits.items(), key=lambda item: item[1])
    over = [x for x in prompts if x["prompt_ids"] and len(x["prompt_ids"]) + max_tokens > limit]
    asked = [x for x in over if x["set"] == prompt_sets.CONTEXT]
    if asked:
        raise ValueError(
            f"{len(asked)} long-context prompt(s) do not fit {why} of {limit} tokens with bench.max_tokens "
            f"{max_tokens} to generate, e.g. {asked[0]['id']} ({len(asked[0]['prompt_ids'])} tokens); lower "
            f"bench.context_lengths"
        )
    if over:
        dropped = {x["id"] for x in over}
        dropped |= {x["id"] for x in prompts if x.get("after") in dropped}  # a later turn follows its first
        print(
            f"{len(dropped)} of {len(prompts)} prompt(s) left out: longer than {why} of {limit} tokens with "
            f"bench.max_tokens {max_tokens} to generate (e.g. {over[0]['id']}, {len(over[0]['prompt_ids'])} tokens)"
        )
        prompts = [x for x in prompts if x["id"] not in dropped]
        if not prompts:
            raise ValueError(f"No prompt fits {why} of {limit} tokens with bench.max_tokens {max_tokens}")
    return prompts


def measured_prompts(swept: dict, prompts: list[dict]) -> list[dict]:
    """The prompts the sweep measured: all of them, or those the run's time left room for (its sizing)."""
    ids = {x["id"] for x in swept["prompt_list"]}
    return [x for x in prompts if x["id"] in ids]


def prompts_text(prompts: list[dict]) -> str:
    """Per set: how many prompts (turns), their categories and their lengths in tokens."""
    lines = []
    for name in dict.fromkeys(x["set"] for x in prompts):
        group = [x for x in prompts if x["set"] == name]
        known = [len(x["prompt_ids"]) for x in group if x["prompt_ids"]]
        later = sum(1 for x in group if x.get("turn", 1) > 1)
        cats = sorted({x["category"] for x in group if x["category"]})
        lines.append(
            f"{name}: {len(group)} prompts"
            + (f" ({later} later turns, built from the baseline's answers)" if later else "")
            + (f", {min(known)}-{max(known)} tokens" if known else "")
            + (f"; categories: {', '.join(cats)}" if cats else "")
        )
    return "\n".join(lines)


def baseline_sequences(swept: dict, prompts: list[dict]) -> list[dict]:
    """[{id, set, prompt_ids, token_ids}]: each prompt with the baseline's (the target's own) reply at the lowest
    concurrency, the text the per-set prediction evaluates the drafter on."""
    by_id = {x["id"]: x for x in prompts}
    return [
        {"id": o["id"], "set": by_id[o["id"]]["set"], "prompt_ids": by_id[o["id"]]["prompt_ids"],
         "token_ids": o["token_ids"]}
        for o in swept["baseline_outputs"][min(swept["baseline_outputs"], key=int)]
        if o["id"] in by_id and o["token_ids"]
    ]  # fmt: skip


def sets_figures(swept: dict, predicted: dict | None) -> dict:
    """The per set tables at every concurrency, per category and per context length, and the per set
    prediction against the measurement."""
    rows = swept["rows"]
    tables = [per_set.set_table(rows, c, predicted) for c in sorted({r["concurrency"] for r in rows})]
    return {
        "tables": tables,
        "categories": per_set.category_table(rows),
        "context": per_set.context_table(rows),
        "predicted_against_measured": [x for t in tables for x in per_set.predicted_against_measured(t)
                                       if t["concurrency"] == tables[0]["concurrency"]],
        "predicted": predicted,
    }  # fmt: skip


def sampling_text(swept: dict) -> str:
    """With temperature > 0: the distribution check of every depth; greedy: what losslessness means here."""
    if not swept.get("sampling"):
        return "greedy decoding: losslessness is checked token for token (above)"
    s = swept["sampling"]
    lines = [f"temperature {s['temperature']}, top-p {s['top_p']}: outputs are sampled, so losslessness is a test "
             "of the token distributions of speculative against plain decoding"]  # fmt: skip
    for check in s["distribution_checks"]:
        lines.append(f"depth {check['depth']}: " + sampling.sampling_text(check))
    return "\n".join(lines)


def replay_depths(swept: dict, bench_params) -> list[int]:
    """The depths to replay: the user's (bench.depths) that the sweep measured, the cost model's picks and the
    fastest measured depth (the headline's)."""
    model = swept.get("cost_model") or {}
    picks, predicted_only = model.get("picks", {}), set(model.get("predicted_only", []))
    best = best_speculative(swept["rows"])
    asked = set(bench_params.depths) - predicted_only  # a depth only predicted is not replayed either
    return sorted(asked | set(picks.values()) | ({best["depth"]} if best else set()))


def lossless_headline(swept: dict) -> str:
    """The worst share of speculative outputs equal to the baseline's at the same concurrency, set beside the
    share on which the baseline agrees with itself across concurrency when the engine ran in bf16: there a
    batch's kernels round differently, so the baseline is the bar, not 100%."""
    rows = [r for r in swept["rows"] if r["depth"]]
    if swept.get("sampling"):
        checks = swept["sampling"]["distribution_checks"]
        worst = min(checks, key=lambda c: c["p_value"], default=None)
        return (
            "sampled: no distribution check ran"
            if worst is None
            else (
                f"sampled, distribution check {'passed' if all(c['passed'] for c in checks) else 'FAILED'} "
                f"(lowest p = {worst['p_value']:.3g}, depth {worst['depth']})"
            )
        )
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


def asked_depths(swept: dict, bench_params) -> list[dict]:
    """The user's depths (bench.depths) at every concurrency: {depth, concurrency, speedup, accept_len, how}, how
    being "measured" (every prompt), "quick" (bench.quick_prompts prompts) or "predicted" (the cost model calibrated
    on the measured depths; bench.asked_depths: predict)."""
    model = swept.get("cost_model") or {}
    full = max((r.get("prompts", 0) for r in swept["rows"]), default=0)
    predicted = {(r["depth"], r["concurrency"]): r for r in model.get("predicted", [])}
    out = []
    for d in bench_params.depths:
        for c in bench_params.concurrency:
            row = next((r for r in swept["rows"] if r["depth"] == d and r["concurrency"] == c), None)
            if row is not None:
                how = "measured" if row.get("prompts", 0) == full else f"quick ({row['prompts']} prompts)"
                out.append(
                    dict(depth=d, concurrency=c, speedup=row["speedup"], accept_len=row.get("accept_len"), how=how)
                )
            elif (d, c) in predicted:
                x = predicted[(d, c)]
                out.append(
                    dict(depth=d, concurrency=c, speedup=x["speedup"], accept_len=x["accept_len"], how="predicted")
                )
    return out


def asked_depths_text(rows: list[dict]) -> str:
    """asked_depths as lines: each depth's speedup and acceptance length, and how it was found."""
    return (
        "\n".join(
            f"depth {r['depth']:>2}, concurrency {r['concurrency']}: {r['speedup']:.2f}x, acceptance length "
            f"{_fmt_al(r['accept_len'])} ({r['how']})"
            for r in rows
        )
        or "no depth asked for (bench.depths is empty)"
    )


def _fmt_al(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def recommendation_text(recommendation: dict, scheduled: dict | None = None) -> str:
    """The fastest configuration per concurrency with its launch commands, then the depth schedule's."""
    text = "\n".join(
        f"concurrency {c}: {r['config']} at {r['tokens_per_s']} tokens/s ({r['speedup']}x the baseline)\n"
        f"  vLLM:   {r['vllm']}\n  SGLang: {r['sglang']}\n"
        for c, r in recommendation.items()
    )
    if scheduled:
        text += (
            f"\none server for every load, the depth schedule ({scheduled['text']}):\n"
            f"  vLLM:   {scheduled['vllm']}\n  SGLang: {scheduled['sglang']}\n"
        )
    return text


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


def result(
    swept: dict,
    recommendation: dict,
    replayed: dict,
    prompts: int,
    max_tokens: int,
    sets: dict | None = None,
    asked: list[dict] | None = None,
) -> dict:
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
        "asked_depths": asked,
        "prompt_list": swept.get("prompt_list"),
        "sampling": swept.get("sampling"),
        "sets": sets,
        "sizing": swept.get("sizing"),
        "load": swept.get("load", []),
        "schedule": swept.get("schedule"),
    }
    best = best_speculative(rows)
    headline = {
        "best speedup": best and f"{best['speedup']:.2f}x ({best['config']}, concurrency {best['concurrency']})",
        "acceptance length": best and _round(best["accept_len"], 2),
        "replay acceptance": best and _round(replayed["summary"].get(str(best["depth"]), {}).get("accept_len"), 2),
        "lossless": lossless_headline(swept),
    }
    if (sized := swept.get("sizing")) and sized["prompts"] < sized["asked"]:
        headline["prompts (run.minutes)"] = (
            f"{sized['prompts']} of {sized['asked']}: all would take ~{sized['asked_estimate_s'] / 60:.0f} min here, "
            f"{sized['seconds_left'] / 60:.0f} were left"
        )
    if swept.get("cost_model"):
        picks = swept["cost_model"]["picks"]
        headline["cost model picks"] = ", ".join(f"{d} at concurrency {c}" for c, d in picks.items())
    if any(r.get("p90_itl_ms") is not None for r in rows):
        headline["p90 inter-token latency"] = under_load.latency_headline(rows, recommendation)
    if swept.get("schedule"):
        against = under_load.schedule_against_fixed(swept.get("load", []))
        figures["schedule_against_fixed"] = against
        headline["depth schedule"] = swept["schedule"]["text"] + (
            f" (mean {against['means']['schedule']:.1f} tokens/s under load, best fixed "
            f"{max(v for k, v in against['means'].items() if k != 'schedule'):.1f})"
            if against and "schedule" in against["means"]
            else ""
        )
    return {"figures": figures, "headline": headline, "artifacts": ARTIFACTS}
