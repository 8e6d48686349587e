"""One configuration on its own server: started, warmed up, each concurrency measured (the engine's statistics
diffed around it, speedup/measurement.py), the serving load run, stopped; and its outputs against the baseline's.
The sweep (speedup/sweep.py) runs one per configuration."""

from __future__ import annotations

from eagle3lib import engines
from eagle3lib.engines.schedule import varying
from eagle3lib.speedup import measurement, prompt_sets


def measure(server, prompts: list[dict], max_tokens: int, concurrency: int, generate: dict | None = None) -> dict:
    """One measurement per set, each set's requests on their own: the row's figures over every set but the
    context one, and each set's own figures under `sets` (per request figures at concurrency 1, `requests`)."""
    generate = generate or {}
    sets, outputs, parts, walls, all_outputs, requests = {}, [], [], 0.0, [], []
    for name in dict.fromkeys(p["set"] for p in prompts):
        group = [p for p in prompts if p["set"] == name]
        m = measurement.measure_set(server, group, max_tokens, concurrency, generate)
        sets[name] = measurement.figures(server.name, m["parts"], m["outputs"], m["wall"])
        requests += m["requests"]
        all_outputs += [
            {"id": p["id"], "token_ids": o["token_ids"], "text": o["text"]} for p, o in zip(group, m["outputs"])
        ]
        if name != prompt_sets.CONTEXT:
            outputs += m["outputs"]
            parts += m["parts"]
            walls += m["wall"]
    return {
        "concurrency": concurrency,
        **measurement.figures(server.name, parts, outputs, walls),
        "sets": sets,
        "request_figures": [{k: v for k, v in r.items() if k != "parts"} for r in requests],
        "request_parts": [r["parts"][0] for r in requests],
        "outputs": all_outputs,
    }


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
    size=None,
    load=None,
) -> tuple[list[dict], dict | None, list[dict]]:
    """Start a server for one configuration (depth: None, a depth or a DepthSchedule), warm it up, measure each
    concurrency, stop it (always).

    generate: sampling arguments for server.generate (temperature, top_p); size(server) -> the prompts to measure,
    run after the warm-up (the baseline sizes the sweep there); prepare(server): run after it, before measuring
    (the baseline answers the first turns there); sample(server) -> the draws of the distribution check;
    load(server, config, schedule) -> the load rows (speedup/load.py), run last. Returns (rows, draws, load rows)."""
    server = engines.make(engine_params, target_dir, draft_dir, depth, log_dir, dtype)
    with server:
        warm = server.generate(prompts[0]["prompt_ids"], min(8, max_tokens))  # warm-up, not measured
        per_token = warm["seconds"] / max(1, warm["completion_tokens"] or 1)  # the prompt's time in it: generous
        server.request_timeout_s = engines.request_timeout_s(per_token, max_tokens, max(concurrency))
        if size is not None:
            prompts = size(server)
        if prepare is not None:
            prepare(server)
        low = min(concurrency)
        rows = [
            measure(
                server, [p for p in prompts if c == low or p["set"] != prompt_sets.CONTEXT], max_tokens, c, generate
            )
            for c in concurrency
        ]
        draws = sample(server) if sample is not None else None
        schedule, varies = engines.as_schedule(depth), varying(depth)
        loaded = load(server, engines.config_name(depth, dtype), varies and varies.as_json()) if load else []
    for r in rows:
        r.update(
            engine=engine_params.name,
            depth=schedule.depth_at(r["concurrency"]) if schedule else 0,  # a schedule's: the depth at this load
            schedule=varies and varies.as_json(),
            config=engines.config_name(depth, dtype),
            ready_s=server.ready_s,
            log=str(server.log_path),
            group=server.group,
        )
    return rows, draws, loaded


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
