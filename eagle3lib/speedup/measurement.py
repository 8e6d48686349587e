"""One group of requests measured on a running server: the requests sent, the engine's speculative statistics
read around them (vLLM's cumulative /metrics counters, diffed; SGLang's per-request meta_info), and their figures
(throughput, time per output token, acceptance); and the sampled completions of the distribution check
(speedup/sampling.py). The sweep (speedup/sweep.py) measures each prompt set this way."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from eagle3lib import engines


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


def figures(engine: str, parts: list, outputs: list[dict], wall: float) -> dict:
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
                 **figures(server.name, [part], [out], out["seconds"])}
            )  # fmt: skip
        wall = time.perf_counter() - t0
    else:
        before = _reading(server)
        outputs, wall = run_requests(server, prompts, max_tokens, concurrency, **generate)
        parts, requests = [_part(server, before, outputs)], []
    return {"outputs": outputs, "parts": parts, "wall": wall, "requests": requests}


def draw_samples(server, prompts: list[dict], samples: int, max_tokens: int, concurrency: int, generate: dict) -> dict:
    """{prompt id: [token ids of each sample]}: `samples` independent sampled completions of each prompt."""
    out = {}
    for p in prompts:
        got, _ = run_requests(server, [p] * samples, max_tokens, concurrency, ignore_eos=True, **generate)
        out[p["id"]] = [o["token_ids"] for o in got]
    return out
