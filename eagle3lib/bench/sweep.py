"""Depth sweeps against a no-speculation baseline (issue 5, docs/design.md §5).

Configurations: the baseline (no speculation), then each depth in bench.depths in order. A depth is a
launch flag, so each configuration gets its own server (restarted); inside one server every
concurrency level is measured with the engine's statistics diffed around it (vLLM's cumulative
/metrics counters; SGLang's per-request meta_info). One warm-up request precedes the measurements.

Prompts: the prepare stage's held-out bench split up to its first reply, rendered with the target's
chat template and sent as token ids (every engine sees the same tokens); greedy, ignore_eos,
fixed max_tokens. Losslessness: the share of prompts whose output tokens equal the baseline's at the
same concurrency (in bf16 the kernels of a batch of 1 and of a verify step round differently, so
run with bench.dtype float32 to check it token for token; docs/design.md §3).
"""

from __future__ import annotations

import shlex
import time
from concurrent.futures import ThreadPoolExecutor

from tqdm.auto import tqdm

from eagle3lib import engines
from eagle3lib.bench import cost, prompt_sets, sampling
from eagle3lib.prepare import conversations

CONTEXT = "context"  # the long-context prompts' set: measured at the lowest concurrency, outside the overall row

# ------------------------------------------------------------------------------ inputs ----


def prompt_ids(tokenizer, bench: list[dict], n: int) -> list[dict]:
    """The held-out set alone (bench.prompts [held_out]): its first n prompts as prompt_sets.build_prompts
    gives them."""
    out = prompt_sets.build_prompts(prompt_sets.renderer(tokenizer), [prompt_sets.HELD_OUT], n, bench)
    if not out:
        raise ValueError("Expected bench prompts, found none: data.bench_count is 0 or the bench split is empty.")
    return out


def take(prompts: list[dict], n: int) -> list[dict]:
    """n of the prompts, the sets taking turns (each set's order kept), so a quick measurement still covers
    every set; the context set is left out (it is measured on every prompt or not at all)."""
    sets = {}
    for p in prompts:
        if p.get("set") != CONTEXT:
            sets.setdefault(p.get("set"), []).append(p)
    chosen = {id(p) for p in conversations.interleave(*sets.values())[:n]}
    return [p for p in prompts if id(p) in chosen]


def predicted(eval_summary: dict, depth: int) -> dict:
    """Acceptance a chain of `depth` should get from the training eval's cond_acc (docs/design.md §5):
    per_pos[k] = joint_acc[k] = Π_{j≤k} cond_acc[j] (positions past the trained steps reuse the last
    cond_acc), accept_len = 1 + Σ per_pos."""
    cond = list(eval_summary["cond_acc"])
    return {**cost.acceptance(cond, depth), "extrapolated_from": len(cond)}


# ------------------------------------------------------------------------- measurement ----


def run_requests(
    server, prompts: list[dict], max_tokens: int, concurrency: int, **generate
) -> tuple[list[dict], float]:
    """All prompts through server.generate with `concurrency` requests in flight; (outputs in prompt order, wall s)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outputs = list(pool.map(lambda pr: server.generate(pr["prompt_ids"], max_tokens, **generate), prompts))
    return outputs, time.perf_counter() - t0


def _reading(server):
    """What a measurement diffs: vLLM's cumulative counters; SGLang reports per request (meta_info)."""
    return server.stats() if server.name == "vllm" else None


def _part(server, before, outputs: list[dict]):
    """The speculative statistics of the requests since `before`: a vLLM counter diff, or SGLang's metas."""
    if server.name == "vllm":
        return engines.vllm.stats_diff(before, server.stats())
    return [o["meta"] | {"completion_tokens": o["completion_tokens"]} for o in outputs]


def spec_over(engine: str, parts: list) -> dict:
    """Acceptance over several measurements' statistics (their counters summed)."""
    if engine == "vllm":
        return engines.vllm.sum_diffs(parts)
    return engines.sglang.aggregate_meta([m for part in parts for m in part])


def _figures(engine: str, parts: list, outputs: list[dict], wall: float) -> dict:
    """Throughput, time per output token and acceptance of a group of requests measured in `wall` seconds."""
    spec = spec_over(engine, parts)
    tokens = sum(o["completion_tokens"] for o in outputs)
    return {
        "requests": len(outputs),
        "completion_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": tokens / wall if wall else 0.0,
        # request latency / its output tokens (prefill included), mean over requests
        "tpot_ms": 1000 * sum(o["seconds"] / max(o["completion_tokens"], 1) for o in outputs) / max(len(outputs), 1),
        "accept_len": spec.get("accept_len"),
        "per_pos": spec.get("per_pos", []),
        "drafts": spec.get("drafts", 0),
        # the engine's own request timings where it reports them (vLLM): the cost model's prefill share
        "prefill_s": spec.get("prefill_s"),
        "decode_s": spec.get("decode_s"),
    }


def measure_set(server, prompts: list[dict], max_tokens: int, concurrency: int, generate: dict) -> dict:
    """One set's prompts as one measurement. At concurrency 1 the statistics are also read around every request
    (per request acceptance: categories and context lengths come from these)."""
    if concurrency == 1:
        outputs, parts, requests = [], [], []
        t0 = time.perf_counter()
        for p in prompts:
            before = _reading(server)
            out = server.generate(p["prompt_ids"], max_tokens, **generate)
            part = _part(server, before, [out])
            outputs.append(out)
            parts.append(part)
            requests.append(
                {"id": p["id"], "set": p["set"], "category": p.get("category", ""), "turn": p.get("turn", 1),
                 "prompt_tokens": len(p["prompt_ids"]), "parts": [part],
                 **_figures(server.name, [part], [out], out["seconds"])}
            )  # fmt: skip
        wall = time.perf_counter() - t0
    else:
        before = _reading(server)
        outputs, wall = run_requests(server, prompts, max_tokens, concurrency, **generate)
        parts, requests = [_part(server, before, outputs)], []
    return {"outputs": outputs, "parts": parts, "wall": wall, "requests": requests}


def measure(server, prompts: list[dict], max_tokens: int, concurrency: int, generate: dict | None = None) -> dict:
    """One measurement per set, each set's requests on their own: the row's figures over every set but the
    context one, and each set's own figures under `sets` (per request figures at concurrency 1, `requests`)."""
    generate = generate or {}
    sets, outputs, parts, walls, all_outputs, requests = {}, [], [], 0.0, [], []
    for name in dict.fromkeys(p["set"] for p in prompts):
        group = [p for p in prompts if p["set"] == name]
        m = measure_set(server, group, max_tokens, concurrency, generate)
        sets[name] = _figures(server.name, m["parts"], m["outputs"], m["wall"])
        requests += m["requests"]
        all_outputs += [
            {"id": p["id"], "token_ids": o["token_ids"], "text": o["text"]} for p, o in zip(group, m["outputs"])
        ]
        if name != CONTEXT:
            outputs += m["outputs"]
            parts += m["parts"]
            walls += m["wall"]
    return {
        "concurrency": concurrency,
        **_figures(server.name, parts, outputs, walls),
        "sets": sets,
        "request_figures": [{k: v for k, v in r.items() if k != "parts"} for r in requests],
        "request_parts": [r["parts"][0] for r in requests],
        "outputs": all_outputs,
    }


def draw_samples(server, prompts: list[dict], samples: int, max_tokens: int, concurrency: int, generate: dict) -> dict:
    """{prompt id: [token ids of each sample]}: `samples` independent sampled completions of each prompt."""
    out = {}
    for p in prompts:
        got, _ = run_requests(server, [p] * samples, max_tokens, concurrency, ignore_eos=True, **generate)
        out[p["id"]] = [o["token_ids"] for o in got]
    return out


def run_config(
    engine_params,
    target_dir,
    draft_dir,
    depth: int | None,
    prompts: list[dict],
    max_tokens: int,
    concurrency: list[int],
    log_dir,
    dtype: str | None = None,
    generate: dict | None = None,
    prepare=None,
    sample=None,
) -> tuple[list[dict], dict | None]:
    """Start a server for one configuration, warm it up, measure each concurrency, stop it (always).

    generate: sampling arguments for server.generate (temperature, top_p); prepare(server): run after the
    warm-up, before measuring (the baseline answers the first turns there); sample(server) -> the draws of
    the distribution check. Returns (rows, draws)."""
    server = engines.make(engine_params, target_dir, draft_dir, depth, log_dir, dtype)
    with server:
        server.generate(prompts[0]["prompt_ids"], min(8, max_tokens))  # warm-up, not measured
        if prepare is not None:
            prepare(server)
        low = min(concurrency)
        rows = [
            measure(server, [p for p in prompts if c == low or p["set"] != CONTEXT], max_tokens, c, generate)
            for c in concurrency
        ]
        draws = sample(server) if sample is not None else None
    for r in rows:
        r.update(
            engine=engine_params.name,
            depth=depth or 0,
            config=engines.config_name(depth, dtype),
            ready_s=server.ready_s,
            log=str(server.log_path),
            group=server.group,
        )
    return rows, draws


def compare_outputs(outputs: list[dict], baseline: list[dict]) -> dict:
    """{lossless_frac, differences: [{id, first_diff, baseline, speculative}]} by output tokens, each output
    against the baseline's of the same prompt id (an output that is a prefix of the other differs where the
    shorter ends)."""
    diffs = []
    by_id = {b["id"]: b for b in baseline}
    missing = [o["id"] for o in outputs if o["id"] not in by_id]
    if missing:
        raise ValueError(f"no baseline output for prompt(s) {missing}: compare outputs of the same prompts")
    for o in outputs:
        b = by_id[o["id"]]
        if o["token_ids"] != b["token_ids"]:
            k = next(
                (i for i, (x, y) in enumerate(zip(o["token_ids"], b["token_ids"])) if x != y),
                min(len(o["token_ids"]), len(b["token_ids"])),
            )
            diffs.append({"id": o["id"], "first_diff": k, "baseline": b["text"][:200], "speculative": o["text"][:200]})
    return {"lossless_frac": 1 - len(diffs) / len(outputs), "differences": diffs}


def preflight(engine_params, target_dir, draft_dir, depths) -> None:
    """Before any launch: SGLang's own ServerArgs resolution of the launch flags at each depth (EngineError
    lists the problems); vLLM's flags need no resolving ahead."""
    if engine_params.name == "sglang":
        for d in depths:
            engines.sglang.preflight(target_dir, draft_dir, d, engines.python_for(engine_params))


def benchmark(
    engine_params,
    bench_params,
    target_dir,
    draft_dir,
    prompts: list[dict],
    log_dir,
    eval_summary: dict | None = None,
    progress=print,
    measure_costs=None,
    render=None,
) -> dict:
    """The sweep: the baseline, then the depths worth measuring, at each concurrency (docs/design.md §5).

    With the training eval's acceptance (eval_summary) and measure_costs (a callable, run after the baseline
    server stops, returning the in-process (forward_ms, draft_ms) of bench.cost.forward_costs), the cost model
    predicts every depth 1..bench.max_depth; the depth it picks at the lowest concurrency is measured first and
    calibrates it (bench.cost.calibrate), then the pick at each concurrency, the lowest one's neighbours and
    bench.depths follow, fastest predicted first. Depths predicted below bench.quick_below at every concurrency
    run bench.quick_prompts prompts. Without them, bench.depths in order.

    Returns {rows, differences, recommendation, cost_model, ...}; rows carry the fields of issue 5 plus
    tpot_ms, drafts, efficiency, predicted_speedup, prompts, ready_s, log; baseline_outputs holds the
    no-speculation outputs per concurrency. progress: a callable for status lines (a tqdm.auto bar counts the
    configurations too), or None for quiet.

    prompts: prompt_sets.build_prompts's (each labelled by its set); a row holds every set's figures under
    `sets` and is itself over every set but the long-context one, which runs at the lowest concurrency only.
    A later turn is built (render: messages -> ids) from the baseline's answer to the turn before it. With
    bench.temperature > 0 the requests are sampled, losslessness is the distribution check (bench.sampling)
    of bench.samples draws per prompt against the baseline's, and outputs are not compared token for token."""
    dtype = bench_params.dtype
    started = time.time()
    rows, outputs, differences, draws, checks = [], {}, [], {}, []
    say = progress or (lambda _line: None)
    bar = tqdm(total=1 + len(bench_params.depths), desc="sweep", unit="config", disable=progress is None)
    sampled = bench_params.temperature > 0
    generate = {"temperature": bench_params.temperature, "top_p": bench_params.top_p}
    pending = [p for p in prompts if p["prompt_ids"] is None]
    if pending and render is None:
        raise ValueError(f"{pending[0]['id']} follows an earlier turn's answer: pass render to build its prompt")

    def answer_first_turns(server):
        """The baseline's greedy answers to the turns that later turns follow (stopping at end of text)."""

        def answer(turns):
            got, _ = run_requests(
                server, turns, bench_params.max_tokens, max(bench_params.concurrency), ignore_eos=False
            )
            return got

        prompt_sets.complete_turns(prompts, answer, render)

    def sample_draws(server):
        chosen = take(prompts, bench_params.sample_prompts)
        return draw_samples(
            server, chosen, bench_params.samples, bench_params.sample_tokens, max(bench_params.concurrency), generate
        )

    def run(
        depth: int | None, used: list[dict], prediction=None, note: str = "", calibration=False, concurrency=None
    ) -> list[dict]:
        say(f"[bench] {engines.config_name(depth, dtype)}: starting {engine_params.name} ({len(used)} prompts{note})")
        bar.set_postfix_str(engines.config_name(depth, dtype))
        measured = []
        got, drawn = run_config(
            engine_params, target_dir, draft_dir, depth, used, bench_params.max_tokens,
            concurrency or bench_params.concurrency, log_dir, dtype, generate,
            prepare=answer_first_turns if depth is None and pending else None,
            sample=sample_draws if sampled and bench_params.samples else None,
        )  # fmt: skip
        if drawn is not None:
            draws[depth or 0] = drawn
            if depth is not None:
                check = sampling.distribution_check(draws[0], drawn, alpha=bench_params.sample_alpha)
                checks.append({"depth": depth, **check})
                say(
                    f"[bench]   distribution check: p = {check['p_value']:.3g} ({'passed' if check['passed'] else 'FAILED'})"
                )
        for r in got:
            outs = r.pop("outputs")
            r["prompts"] = len([p for p in used if p["set"] != CONTEXT])
            if depth is None:
                outputs[r["concurrency"]] = outs
                base = r
            else:
                base = next(x for x in rows if x["depth"] == 0 and x["concurrency"] == r["concurrency"])
                if not sampled:  # sampled outputs are compared in distribution (draws), not token for token
                    cmp = compare_outputs(outs, outputs[r["concurrency"]])
                    r["lossless_frac"] = cmp["lossless_frac"]
                    differences.extend(
                        d | {"depth": depth, "concurrency": r["concurrency"]} for d in cmp["differences"]
                    )
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
            for name, f in r["sets"].items():
                f["speedup"] = f["tokens_per_s"] / base["sets"][name]["tokens_per_s"]
            r.setdefault("lossless_frac", None if sampled else 1.0)
            if depth is None:
                r.update(accept_len=None, per_pos=[], predicted_accept_len=None, predicted_per_pos=[])
            elif eval_summary is not None:
                pred = predicted(eval_summary, depth)
                r.update(predicted_accept_len=pred["accept_len"], predicted_per_pos=pred["per_pos"])
            if prediction is not None:
                r["predicted_speedup"] = prediction[(depth, r["concurrency"])]["speedup"]
                r["calibration"] = calibration
            # issue 5's goal: tokens/s >= 0.8 x acceptance length x baseline tokens/s, i.e. efficiency >= 0.8
            r["efficiency"] = r["speedup"] / r["accept_len"] if r.get("accept_len") else None
            rows.append(r)
            measured.append(r)
            say(
                f"[bench]   concurrency {r['concurrency']}: {r['tokens_per_s']:.1f} tokens/s, speedup "
                f"{r['speedup']:.2f}"
                + (f" (predicted {r['predicted_speedup']:.2f})" if r.get("predicted_speedup") else "")
                + f", acceptance {_fmt(r.get('accept_len'))}, lossless {_fmt(r['lossless_frac'])}"
            )
        bar.update(1)
        return measured

    run(None, prompts)
    model = None
    if bench_params.pick_depth and eval_summary is not None and measure_costs is not None:
        model = choose_and_measure(bench_params, eval_summary, measure_costs, rows, prompts, run, bar, say)
    else:
        for depth in bench_params.depths:
            run(depth, prompts)
    bar.close()
    baseline_agree = None
    if len(outputs) > 1 and not sampled:  # the baseline against itself across concurrency: batching's own rounding
        cs = sorted(outputs)
        baseline_agree = compare_outputs(outputs[cs[-1]], outputs[cs[0]])["lossless_frac"]
    return {
        "rows": rows,
        "differences": differences,
        "baseline_agreement_across_concurrency": baseline_agree,
        "baseline_outputs": {str(c): outs for c, outs in outputs.items()},  # [{id, token_ids, text}] per concurrency
        "prompt_list": [
            {k: p[k] for k in ("id", "set", "category", "turn")} | {"prompt_tokens": len(p["prompt_ids"])}
            for p in prompts
        ],  # fmt: skip
        "sampling": {**generate, "distribution_checks": checks} if sampled else None,
        "dtype": dtype or "engine default",
        "restart_per_configuration": True,
        "lossless_reference": f"baseline (no speculation) at the same concurrency, dtype {dtype or 'engine default (bf16 on CPU)'}",
        "cost_model": model,
        "seconds": round(time.time() - started, 1),
    }


def choose_and_measure(bench_params, eval_summary, measure_costs, rows, prompts, run, bar, say) -> dict:
    """The cost model's part of the sweep (see benchmark): costs from the baseline rows and measure_costs,
    the first pick measured and used to calibrate, then the rest of the plan. Returns the model's record:
    its costs, the predictions before and after calibration, and the plan."""
    conc = list(bench_params.concurrency)
    depths = list(range(1, bench_params.max_depth + 1))
    cond = list(eval_summary["cond_acc"])
    decode, share = cost.decode_costs([r for r in rows if r["depth"] == 0])
    forward, draft = measure_costs()
    costs = cost.Costs(decode, forward, draft, share)
    before = cost.predict(costs, cond, depths, conc)
    first = cost.best_depth(before, min(conc))["depth"]
    say(f"[bench] cost model: depth {first} predicted fastest at concurrency {min(conc)}; measuring it first")
    bar.total += 1
    measured = run(first, prompts, {(r["depth"], r["concurrency"]): r for r in before}, ", calibrates", True)
    costs = cost.calibrate(costs, cond, measured)
    after = cost.predict(costs, cond, depths, conc)
    by_key = {(r["depth"], r["concurrency"]): r for r in after}
    picks = {c: cost.best_depth(after, c)["depth"] for c in conc}
    low = picks[min(conc)]
    neighbours = (low - 1, low + 1) if bench_params.neighbours else ()
    plan = sorted(
        {*picks.values(), *(d for d in neighbours if 1 <= d <= bench_params.max_depth)} - {first},
        key=lambda d: -max(by_key[(d, c)]["speedup"] for c in conc),
    )
    asked = [d for d in bench_params.depths if d not in plan and d != first]
    predicted_only = asked if bench_params.asked_depths == "predict" else []
    plan += [d for d in asked if d not in predicted_only]
    bar.total += len(plan) - len(bench_params.depths)
    quick = []
    for d in plan:
        # each depth's prediction comes from the model calibrated on the depths measured before it
        ahead = {(d, c): cost.predict(costs, cond, [d], [c])[0] for c in conc}
        best_predicted = max(r["speedup"] for r in ahead.values())
        asked_quick = bench_params.asked_depths == "quick" and d in asked
        if asked_quick or (best_predicted < bench_params.quick_below and d not in picks.values()):  # picks: in full
            quick.append(d)
        # asked depths in quick mode: a few prompts at the lowest concurrency (the user's question, answered cheaply)
        few = bench_params.quick_prompts if asked_quick else max(bench_params.quick_prompts, max(conc))
        used = take(prompts, few) if d in quick else prompts
        note = f", predicted {best_predicted:.2f}x" + (": quick" if d in quick else "")
        measured += run(d, used, ahead, note, concurrency=[min(conc)] if asked_quick else None)
        costs = cost.calibrate(costs, cond, measured)
    if predicted_only:
        say(
            f"[bench] depths {predicted_only} predicted by the calibrated cost model, not measured (bench.asked_depths)"
        )
    final = cost.predict(costs, cond, depths, conc)
    return {
        "costs": costs.as_dict(),
        "predicted_before_calibration": before,
        "predicted_after_first": after,
        "predicted": final,
        "picks": {str(c): d for c, d in picks.items()},
        "final_picks": {str(c): cost.best_depth(final, c)["depth"] for c in conc},
        "calibrated_on": first,
        "plan": [first, *plan],
        "quick": quick,
        "predicted_only": predicted_only,
    }


def lowest_concurrency_baseline(swept: dict) -> list[dict]:
    """benchmark()'s no-speculation outputs at the lowest concurrency: what a replay of the same prompts,
    greedy and one at a time, must reproduce."""
    outputs = swept["baseline_outputs"]
    return outputs[min(outputs, key=int)]


# ------------------------------------------------------------------------------ report ----


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


def _fmt(x, digits=2):
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
            "speedup": round(r["speedup"], 2),
            "predicted speedup": _fmt(r.get("predicted_speedup")) + (" (calibrates)" if r.get("calibration") else ""),
            "prompts": r.get("prompts", "–"),
            "accept len": _fmt(r.get("accept_len")),
            "predicted": _fmt(r.get("predicted_accept_len")),
            "per position": " ".join(f"{x:.2f}" for x in r.get("per_pos") or []),
            "lossless": "sampled" if r["lossless_frac"] is None else f"{r['lossless_frac']:.0%}",
            "efficiency": _fmt(r.get("efficiency")),
        }
        for r in rows
    ]
