"""Regeneration through a serving engine: conversations in a window against hf-style waves, one server.

Prints tokens/s of each mode, their ratio and whether their records are identical.

Regeneration through a serving engine: conversations in a window against hf-style waves, one server.

    python -m benchmarks regenerate                       # vLLM's CPU build, the embedded default
    python -m benchmarks regenerate --params params/smollm2-135m-gpu.yaml --conversations 2000  # SGLang, GPU
    python -m benchmarks regenerate --params params/smollm2-135m-gpu-release.yaml --conversations 2000 \
        --max-new-tokens 256 --window 1024 --modes window --drop-flag=--disable-cuda-graph \
        --engine-flag=--cuda-graph-max-bs-decode=512 --engine-flag=--disable-prefill-cuda-graph
        (the release's regeneration with two of its rate's levers: conversations in flight, decode CUDA graphs)

Both modes send the same conversations to the same running server with the same number of requests
allowed in flight (--window), after a warm-up. waves: what hf does, a wave of turns at a time, the next wave after the
wave's longest reply; window: data.regenerate's engine mode, each conversation on to its next turn as soon
as its reply is back. Prints generated tokens/s of each, their ratio, and whether their records are identical
(with --dtype float32 they must be; bf16 kernels round differently by batch shape, docs/design.md §3).
--modes window measures the engine mode alone (a lever of its rate: --window, --engine-flag, --drop-flag).
"""

import argparse
import json
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks import gpu_script
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


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default="params/smollm2-135m-cpu.yaml")
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--window", type=int, default=16, help="requests in flight (data.regenerate.batch_size)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--dtype",
        help="engine --dtype; float32 on vLLM's CPU build makes replies independent of "
        "batch shape, so the two modes' records must then be identical",
    )
    ap.add_argument("--modes", default="waves,window", help="which of waves,window to measure")
    ap.add_argument("--engine-flag", action="append", default=[], help="an engine flag added (repeatable)")
    ap.add_argument("--drop-flag", action="append", default=[], help="a params engine flag removed (repeatable)")
    ap.add_argument("--stand-in", action="store_true", help="check the options, run nothing (dry run)")
    args = ap.parse_args(argv)
    if args.stand_in:
        return gpu_script.skip(
            "the serving engine's regeneration (an engine server: vLLM's CPU build or SGLang on a GPU)"
        )
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"waves", "window"}:
        ap.error(f"--modes: a comma-separated subset of waves,window, not {args.modes!r}")

    p = load_params(args.params)
    missing = [f for f in args.drop_flag if f not in p.engine.extra_args]
    if missing:
        ap.error(f"--drop-flag {missing}: not among {args.params}'s engine.extra_args {p.engine.extra_args}")
    # a flag of the form --name=value replaces a --name the params give, and its value with it
    p.engine.extra_args = drop_flags(p.engine.extra_args, args.drop_flag + [f.split("=")[0] for f in args.engine_flag])
    p.engine.extra_args += args.engine_flag + (["--dtype", args.dtype] if args.dtype else [])
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
        print(
            f"{p.engine.name} ready in {server.ready_s:.1f} s; {len(convs)} conversations, window {args.window}; "
            f"flags {p.engine.extra_args}"
        )
        regenerate.regenerate_responses(
            model, tokenizer, convs[: args.window], out / "warmup.jsonl", engine=server, **kw
        )
        for mode in modes:
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
    summary = {
        "engine": p.engine.name,
        "engine_flags": p.engine.extra_args,
        "ready_s": round(server.ready_s, 1),
        "conversations": len(convs),
        "in_flight": args.window,
        "max_new_tokens": args.max_new_tokens,
        **results,
    }
    if len(results) == 2:
        same = regenerate.read_regenerated(out / "waves.jsonl") == regenerate.read_regenerated(out / "window.jsonl")
        summary |= {
            "identical_records": same,
            "window_over_waves": round(results["window"]["tokens_per_s"] / results["waves"]["tokens_per_s"], 2),
        }
    print(json.dumps(summary))


def drop_flags(args: list[str], names: list[str]) -> list[str]:
    """args less each flag in names, with its value where one follows it (the next item not a flag)."""
    out, i = [], 0
    while i < len(args):
        if args[i] in names:
            i += 2 if i + 1 < len(args) and not args[i + 1].startswith("--") else 1
            continue
        out.append(args[i])
        i += 1
    return out


def dry_run(work: Path) -> list[str]:
    return ["--stand-in"]


if __name__ == "__main__":
    sys.exit(main())
