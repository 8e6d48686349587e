"""vLLM's CPU worker on one or all cores: baseline and one speculative depth on the same prompts.

Prints tokens/s, AL and speedup per --reserved value and concurrency; --out writes the rows.

vLLM's CPU build with one or all cores for its worker: the baseline and one speculative depth on the same prompts.

    python -m benchmarks vllm_cpu_threads outputs/tiny --depth 3 --reserved 1 0

vLLM keeps VLLM_CPU_NUM_OF_RESERVED_CPU cores (default 1, so one of two on a 2-core machine) for its API server and
scheduler and binds its worker's OpenMP threads to the rest. For each --reserved value this starts the run's engine
compiled (engine.extra_args, no quick-start flags) without a drafter and with the run's vLLM export at --depth,
measures the run's benchmark prompts (held-out, MT-Bench, HumanEval; no long contexts) at each concurrency, and
prints tokens/s, acceptance length and the speedup over that value's own baseline, then writes the rows as JSON.

    python -m benchmarks vllm_cpu_threads outputs/tiny --depth 4 --reserved 1 --concurrency 1 --profile PY_SPY

--profile (the path of a py-spy binary; `pip install py-spy`): py-spy samples vLLM's worker process while the
concurrency-1 prompts run, and each server's row gets where the worker's time per generated token goes (WORK:
the target's forward, its logits, the drafter's proposal, sampling and verification, the rest of the model
runner, and waiting for the scheduler), so that the baseline's and the speculative step's costs compare.
"""

import argparse
import collections
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import gpu_script
from eagle3lib import engines, target
from eagle3lib.params import cache_dir, load_params
from eagle3lib.prepare import conversations
from eagle3lib.speedup import measurement, prompt_sets
from eagle3lib.speedup.notebook import bench_prompts

# What a sampled stack of vLLM's worker is doing, by the first of these frames it holds (in this order): the
# drafter's proposal runs inside sample_tokens, the target's logits outside its forward.
WORK = (
    ("drafter's proposal", "propose_draft_token_ids"),
    ("target forward", "_model_forward"),
    ("target logits", "compute_logits"),
    ("sampling and verification", "sample_tokens"),
    ("rest of the model runner", "_execute_worker_rpc"),
)
WAITING = "waiting for the scheduler"


def worker_pid() -> str:
    """vLLM's worker process (its title is VLLM::Worker; one server runs at a time here)."""
    pids = subprocess.run(["pgrep", "-f", "VLLM::Worker"], capture_output=True, text=True).stdout.split()
    if len(pids) != 1:
        raise RuntimeError(f"Expected one vLLM worker process to profile, found {pids or 'none'}")
    return pids[0]


def work_shares(raw: Path) -> dict[str, float]:
    """{WORK name or WAITING: share of the samples} from py-spy's raw (collapsed) stacks."""
    counts, total = collections.Counter(), 0
    for line in raw.read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        total += int(n)
        counts[next((name for name, frame in WORK if f"{frame} (" in stack), WAITING)] += int(n)
    return {name: counts[name] / total for name, _ in (*WORK, (WAITING, None))}


def measure(p, target_dir, drafter, depth, env, prompts, args, log_dir) -> list[dict]:
    engine = p.engine.model_copy(update={"env": {**p.engine.env, **env}})
    server = engines.make(engine, target_dir, drafter if depth else None, depth, log_dir, args.dtype)
    rows = []
    with server:
        measurement.run_requests(server, prompts[:2], 16, 1)  # warm-up: the first requests compile more
        for c in args.concurrency:
            raw = log_dir / f"profile-r{env['VLLM_CPU_NUM_OF_RESERVED_CPU']}-d{depth or 0}.txt"
            spy = None
            if args.profile and c == 1:
                cmd = [args.profile, "record", "-r", "200", "-f", "raw", "--nonblocking", "-o", str(raw)]
                spy = subprocess.Popen(cmd + ["-p", worker_pid()], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            before = server.stats()
            outputs, wall = measurement.run_requests(server, prompts, args.max_tokens, c)
            spec = engines.vllm.stats_diff(before, server.stats())
            tokens = sum(o["completion_tokens"] for o in outputs)
            row = {
                "reserved": env["VLLM_CPU_NUM_OF_RESERVED_CPU"],
                "depth": depth or 0,
                "concurrency": c,
                "tokens_per_s": round(tokens / wall, 2),
                "accept_len": spec.get("accept_len"),
                "ready_s": round(server.ready_s, 1),
                "token_ids": [o["token_ids"] for o in outputs],
            }
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its samples on SIGINT
                _, err = spy.communicate(timeout=120)
                if not raw.is_file():
                    raise RuntimeError(f"py-spy wrote no profile: {err.decode()[-500:]}")
                row["ms_per_token"] = {k: round(v * wall / tokens * 1000, 2) for k, v in work_shares(raw).items()}
            rows.append(row)
    return rows


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", help="a finished run (its params, bench prompts and 03_convert/vllm)")
    ap.add_argument("--params", default=None, help="default: the run's params file (run.json)")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--reserved", nargs="+", default=["1", "0"], help="VLLM_CPU_NUM_OF_RESERVED_CPU values")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompts", type=int, default=6, help="per set")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default=None, help="engine --dtype (default: the engine's, bf16 for SmolLM2)")
    ap.add_argument("--out", default=None, help="JSON file of the rows")
    ap.add_argument("--profile", default=None, help="a py-spy binary: the worker's time per token at concurrency 1")
    ap.add_argument("--stand-in", action="store_true", help="check the options, run nothing (dry run)")
    args = ap.parse_args(argv)
    if args.stand_in:
        return gpu_script.skip("vLLM's CPU servers: they need .venv-vllm and a finished run with 03_convert/vllm")

    run_dir = Path(args.run_dir)
    params_file = args.params or json.loads((run_dir / "run.json").read_text())["params_file"]
    p = load_params(params_file, {"bench.num_prompts": args.prompts, "bench.context_lengths": []})
    _, tokenizer = target.load_target_info(p.target.name, cache_dir(p))
    held_out = conversations.load_bench_prompts(run_dir / "00_prepare" / "bench.jsonl")
    prompts = [q for q in bench_prompts(p, tokenizer, held_out) if q["set"] != prompt_sets.CONTEXT]
    prompts = [q for q in prompts if q["prompt_ids"]]  # first turns: a later turn needs the baseline's reply
    target_dir = target.resolve_target(p.target.name, cache_dir(p))
    drafter = run_dir / "03_convert" / "vllm"
    log_dir = Path(args.out).parent if args.out else run_dir / "threads"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"{len(prompts)} prompts, {args.max_tokens} tokens each, depth {args.depth}, drafter {drafter}")
    rows = []
    for reserved in args.reserved:
        env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": reserved}
        for depth in (None, args.depth):
            t0 = time.perf_counter()
            got = measure(p, target_dir, drafter, depth, env, prompts, args, log_dir)
            rows += got
            for r in got:
                base = next(
                    b
                    for b in rows
                    if b["reserved"] == reserved and not b["depth"] and b["concurrency"] == r["concurrency"]
                )
                same = sum(a == b for a, b in zip(r["token_ids"], base["token_ids"]))
                print(
                    f"reserved {reserved} depth {r['depth']} c={r['concurrency']}: {r['tokens_per_s']:.1f} tokens/s, "
                    f"speedup {r['tokens_per_s'] / base['tokens_per_s']:.3f}, AL {r['accept_len']}, "
                    f"ready {r['ready_s']} s, {same}/{len(prompts)} replies equal the baseline's "
                    f"({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
                for name, ms in r.get("ms_per_token", {}).items():
                    print(f"    {name}: {ms:.2f} ms a generated token", flush=True)
    if args.out:
        Path(args.out).write_text(
            json.dumps([{k: v for k, v in r.items() if k != "token_ids"} for r in rows], indent=1)
        )


OUT_FILE = "rows.json"


def dry_run(work: Path) -> list[str]:
    return [str(work / "run"), "--stand-in"]


if __name__ == "__main__":
    sys.exit(main())
