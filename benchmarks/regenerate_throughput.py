"""Regeneration through a serving engine: conversations in a window against hf-style waves, one server.

    python benchmarks/regenerate_throughput.py                       # vLLM's CPU build, the embedded default
    python benchmarks/regenerate_throughput.py --params params/tiny-h200.yaml --conversations 2000  # SGLang, GPU

Both modes send the same conversations to the same running server with the same number of requests
allowed in flight (--window), after a warm-up. waves: what hf does, a wave of turns at a time, the next wave after the
wave's longest reply; window: data.regenerate's engine mode, each conversation on to its next turn as soon
as its reply is back. Prints generated tokens/s of each, their ratio, and whether their records are identical
(with --dtype float32 they must be; bf16 kernels round differently by batch shape, docs/design.md §3).
"""

import argparse
import json
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eagle3lib import engines, target
from eagle3lib.params import cache_dir, load_params
from eagle3lib.prepare import regenerate, sources


def wave_generator(server, tokenizer, max_new_tokens, eos_ids, window):
    """hf's batch interface over the engine: a wave's prompts, `window` at a time, all back before it returns."""
    reply = regenerate.engine_reply(server, tokenizer, max_new_tokens, eos_ids, threading.Lock())

    def generate(model, tokenizer, prompts, max_new_tokens, eos_ids):
        with ThreadPoolExecutor(window) as pool:
            return list(pool.map(reply, prompts))

    return generate


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default="params/tiny.yaml")
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--window", type=int, default=16, help="requests in flight (data.regenerate.batch_size)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--dtype",
        help="engine --dtype; float32 on vLLM's CPU build makes replies independent of "
        "batch shape, so the two modes' records must then be identical",
    )
    args = ap.parse_args()

    p = load_params(args.params, {"engine.extra_args": ["--dtype", args.dtype]} if args.dtype else None)
    convs, _ = sources.load_conversations(p.data.sources, limit=args.conversations)
    model, tokenizer = target.load_target_info(p.target.name, cache_dir(p))
    eos_ids = regenerate.eos_token_ids(model, tokenizer)
    kw = dict(
        budget_tokens=10**9,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.window,
        progress=False,
        max_prompt_tokens=p.data.regenerate.max_prompt_tokens,
        backend="engine",
    )
    out, results = Path(tempfile.mkdtemp(prefix="regen-bench-")), {}
    target_dir = target.resolve_target(p.target.name, cache_dir(p))
    with engines.make(p.engine, target_dir, None, None, out) as server:
        print(f"{p.engine.name} ready in {server.ready_s:.1f} s; {len(convs)} conversations, window {args.window}")
        regenerate.regenerate_responses(
            model, tokenizer, convs[: args.window], out / "warmup.jsonl", engine=server, **kw
        )
        for mode in ("waves", "window"):
            t0 = time.perf_counter()
            if mode == "waves":
                stats = regenerate.regenerate_responses(
                    model,
                    tokenizer,
                    convs,
                    out / f"{mode}.jsonl",
                    generate=wave_generator(server, tokenizer, args.max_new_tokens, eos_ids, args.window),
                    **kw,
                )
            else:
                stats = regenerate.regenerate_responses(
                    model, tokenizer, convs, out / f"{mode}.jsonl", engine=server, **kw
                )
            seconds = time.perf_counter() - t0
            results[mode] = {
                "tokens": stats["tokens_generated"],
                "turns": stats["turns_regenerated"],
                "seconds": round(seconds, 2),
                "tokens_per_s": round(stats["tokens_generated"] / seconds, 1),
            }
            print(mode, json.dumps(results[mode]))
    same = regenerate.read_regenerated(out / "waves.jsonl") == regenerate.read_regenerated(out / "window.jsonl")
    print(
        json.dumps(
            {
                "engine": p.engine.name,
                "conversations": len(convs),
                "window": args.window,
                "max_new_tokens": args.max_new_tokens,
                **results,
                "identical_records": same,
                "window_over_waves": round(results["window"]["tokens_per_s"] / results["waves"]["tokens_per_s"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
