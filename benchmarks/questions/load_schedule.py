"""The depth that pays at every load, deployed as the engine's own schedule and measured under the load generator.

The embedded target (SmolLM2-135M-Instruct) and the released drafter (drafters/smollm2-135m-instruct, imported and
exported for SGLang by eagle3lib.convert.layouts), served by SGLang with CUDA graphs up to the highest
concurrency: no speculation, each fixed depth, then the depth schedule those measurements imply
(eagle3lib/speedup/schedule.py) deployed as SGLang's adaptive config (--speculative-adaptive, one candidate depth
per batch size). Every configuration is measured by the sweep itself (eagle3lib/speedup/sweep.py: tokens/s,
acceptance, greedy outputs against the baseline's) and then serves the same first-turn prompts through
`python -m sglang.benchmark.serving` closed-loop at each concurrency (tokens/s, time to first token and
inter-token latency p50/p90/p99). The goal the schedule is held to (eagle3lib/speedup/under_load.py): at every
load at least 0.97x the best fixed configuration's tokens/s, and over the loads a mean at least every fixed one's.

    python -m benchmarks load_schedule --depths 1,3,5 --concurrency 1,4,16,64 --prompts 64

Each configuration has its own server (a depth is a launch flag). --budget-s stops before a configuration that
would not end within that many seconds, with what was measured kept in --state; --resume STATE measures the
configurations that are left (a host whose calls are time-limited runs the same command again with --resume).
Writes summary.json: the sweep's rows, the load rows, the derived schedule and the schedule against the fixed
configurations at every load; prints one JSON line per configuration and load, and the headline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def with_flag(args: list[str], flag: str, value) -> list[str]:
    """Engine flags with `flag` set to `value` (replacing the params' own)."""
    args = [str(a) for a in args]
    if flag in args:
        i = args.index(flag)
        del args[i : i + 2]
    return args + [flag, str(value)]


def first_turns(prompts: list[dict], n: int) -> list[dict]:
    """The first n first-turn prompts (a later turn would need the baseline's answers first)."""
    firsts = [p for p in prompts if p.get("turn", 1) == 1 and p["prompt_ids"]]
    if len(firsts) < n:
        raise SystemExit(f"the sets give {len(firsts)} first-turn prompts, fewer than --prompts {n}")
    return firsts[:n]


def setup(a):
    """(params, target folder, drafter's SGLang export, prompts, load texts) for the options given."""
    from eagle3lib import target
    from eagle3lib.convert import layouts
    from eagle3lib.params import cache_dir, load_params
    from eagle3lib.speedup import load, prompt_sets

    depths = [int(d) for d in a.depths.split(",")]
    concurrency = sorted({int(c) for c in a.concurrency.split(",")})
    sets = [s for s in a.sets.split(",") if s]
    p = load_params(a.params, {
        "bench.depths": depths, "bench.concurrency": concurrency, "bench.prompts": sets,
        "bench.num_prompts": a.prompts, "bench.context_lengths": [],
        "bench.dtype": a.dtype, "bench.schedule": True, "bench.slo_itl_p90_ms": a.slo_itl_p90_ms,
        "bench.load_prompts": a.prompts, "bench.load_rates": [], "bench.pick_depth": False,
    } | ({"bench.max_tokens": a.max_tokens} if a.max_tokens else {}))  # fmt: skip
    extra = with_flag(p.engine.extra_args, "--cuda-graph-max-bs", a.cuda_graph_max_bs or max(concurrency))
    extra = with_flag(extra, "--mem-fraction-static", a.mem_fraction)
    p.engine.extra_args = extra + a.engine_flag
    if a.engine_python:
        p.engine.python = a.engine_python
    cache = cache_dir(p)
    target_dir = target.resolve_target(p.target.name, cache)
    tokenizer = target.load_tokenizer(target_dir, p.target.trust_remote_code)
    canonical = layouts.import_checkpoint(a.drafter, a.work / "drafter" / "canonical", target=target_dir,
                                          cache_dir=cache)  # fmt: skip
    export = layouts.export(canonical, p.engine.name, a.work / "drafter" / p.engine.name, target=target_dir,
                            cache_dir=cache)  # fmt: skip
    built = prompt_sets.build_prompts(prompt_sets.renderer(tokenizer), sets, a.prompts, [], base_dir=Path.cwd())
    prompts = first_turns(built, a.prompts)
    texts = load.load_texts(prompts, tokenizer.decode, a.prompts)
    print(f"target {target_dir}; drafter {a.drafter} -> {export}; {len(prompts)} prompts of {sets}", flush=True)
    return p, target_dir, export, prompts, texts


STATE_KEYS = ("rows", "load_rows", "schedule_rows", "schedule", "missing", "differences")


def save_state(sweep, path: Path, spent: dict) -> None:
    state = {k: getattr(sweep, k) for k in STATE_KEYS}
    state["baseline_outputs"] = {str(c): outs for c, outs in sweep.baseline_outputs.items()}
    state["seconds"] = spent
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, default=str))
    os.replace(tmp, path)


def restore_state(sweep, path: Path) -> dict:
    """The sweep as the state file left it; returns its {config: seconds}."""
    state = json.loads(Path(path).read_text())
    for k in STATE_KEYS:
        setattr(sweep, k, state[k])
    sweep.baseline_outputs = {int(c): outs for c, outs in state["baseline_outputs"].items()}
    return state.get("seconds", {})


def load_row(r: dict) -> dict:
    """A load row as printed and kept: the configuration, its load and the tool's figures."""
    keep = ("config", "schedule", "rate", "concurrency", "load", "completed", "output_tokens", "duration_s",
            "tokens_per_s", "request_throughput")  # fmt: skip
    out = {k: r.get(k) for k in keep}
    out.update({k: v for k, v in r.items() if k.endswith("_ms")})
    return {"kind": "load", **out}


def sweep_row(r: dict) -> dict:
    """A row of the sweep's own measurement, without its per-request detail."""
    keep = ("config", "depth", "schedule", "concurrency", "tokens_per_s", "speedup", "accept_len", "lossless_frac",
            "efficiency", "completion_tokens", "prompts", "ready_s", "p90_itl_ms")  # fmt: skip
    return {"kind": "sweep", **{k: r.get(k) for k in keep}}


def summary(sweep, spent: dict, setup_record: dict) -> dict:
    from eagle3lib.speedup import under_load

    against = under_load.schedule_against_fixed(sweep.load_rows)
    return {
        "what": "tokens/s and latency under the load generator per configuration and load, the depth schedule the "
        "fixed configurations' measurements imply, deployed as SGLang's adaptive config, against them",
        "setup": setup_record,
        "seconds": spent,
        "load": [load_row(r) for r in sweep.load_rows],
        "sweep": [sweep_row(r) for r in sweep.rows + sweep.schedule_rows],
        "schedule": None if sweep.schedule is None else dict(sweep.schedule),
        "against_fixed": against,
        "text": under_load.schedule_text(sweep.schedule, against),
        "missing": sweep.missing,
        "differences": len(sweep.differences),
    }


def resolve(flags: list[str], python: str, problems: list[str]):
    """SGLang's own ServerArgs resolution of launch flags on the CPU (its speculative fields), its problems added to
    `problems`; a line saying why not where the SGLang environment is absent."""
    from eagle3lib.engines.interpreter import InterpreterError, run_engine_side

    try:
        report = run_engine_side("load_check.py", ["sglang", "--args", json.dumps(flags + ["--device", "cpu"])], python)
    except InterpreterError as e:
        return f"not resolved: {str(e).splitlines()[0]}"
    problems += report.get("problems", [])
    return {k: v for k, v in report.get("resolved", {}).items() if "speculative" in k}


def stand_in(a) -> int:
    """The dry run: the target, the drafter's export, the prompts and every launch's flags as SGLang's own
    ServerArgs resolves them on the CPU (a schedule of the given depths as its example), nothing served."""
    from benchmarks import gpu_script
    from eagle3lib import engines
    from eagle3lib.engines.schedule import DepthSchedule

    p, target_dir, export, prompts, texts = setup(a)
    depths, cs = p.bench.depths, p.bench.concurrency
    example = DepthSchedule(tuple(dict.fromkeys([(1, max(depths)), (cs[len(cs) // 2], min(depths)), (cs[-1], 0)])))
    python = engines.python_for(p.engine)
    checked = []
    for depth in [None, *depths, example]:
        flags = engines.sglang.server_flags(target_dir, export, depth, p.engine.extra_args, a.work / "flags")
        flags += ["--dtype", p.bench.dtype] if p.bench.dtype else []
        problems = engines.sglang.check_sglang_args(flags) if depth else []
        resolved = resolve(flags, python, problems) if depth in (max(depths), example) else None  # others: numbers
        row = {"config": engines.config_name(depth, p.bench.dtype), "flags": flags, "problems": problems,
               "resolved": resolved}  # fmt: skip
        print(json.dumps(row), flush=True)
        checked.append(row)
    print(f"{len(prompts)} prompts, {len(texts)} load texts; example schedule: {example.text()}", flush=True)
    gpu_script.skip("serving: SGLang on a GPU, each configuration's server under the load generator")
    return 1 if any(r["problems"] for r in checked) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="params/smollm2-135m-gpu.yaml", help="target, engine and its flags")
    ap.add_argument("--drafter", default="drafters/smollm2-135m-instruct", help="a checkpoint convert reads")
    ap.add_argument("--depths", default="1,3,5", help="the fixed depths, measured in order after the baseline")
    ap.add_argument("--concurrency", default="1,4,16,64", help="requests in flight: the load points")
    ap.add_argument("--sets", default="mt_bench", help="prompt sets (bench.prompts), their first turns")
    ap.add_argument("--prompts", type=int, default=64, help="first-turn prompts, each load point sends them all")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per reply (default: the params' bench's)")
    ap.add_argument("--dtype", default="bfloat16", help="the engine's --dtype for target and drafter")
    ap.add_argument("--slo-itl-p90-ms", type=float, default=None, help="the schedule's latency target (none: speed)")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=None, help="default: the highest concurrency")
    ap.add_argument("--mem-fraction", type=float, default=0.3, help="SGLang's --mem-fraction-static")
    ap.add_argument("--engine-flag", action="append", default=[], help="an extra engine flag (repeatable)")
    ap.add_argument("--engine-python", default=None, help="the interpreter with SGLang (default: the params')")
    ap.add_argument("--budget-s", type=float, default=None, help="start no configuration that would end past it")
    ap.add_argument("--resume", type=Path, default=None, help="a state file of an earlier call: its rows stand")
    ap.add_argument("--state", type=Path, default=None, help="where the state goes (default: OUT's folder)")
    ap.add_argument("--work", type=Path, default=None, help="exports, server and tool logs (default: a temp folder)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stand-in", action="store_true", help="the dry run: check everything up to the launch")
    a = ap.parse_args(argv)
    a.work = a.work or Path(os.environ.get("TMPDIR", "/tmp")) / "benchmarks-load_schedule"
    a.state = a.state or a.out.parent / "state.json"
    if a.stand_in:
        return stand_in(a)

    from eagle3lib import engines
    from eagle3lib.speedup import load, sweep

    started = time.time()
    p, target_dir, export, prompts, texts = setup(a)
    sweeping = load.LoadSweep(load.load_points(p.bench), texts, p.bench.max_tokens, p.engine, str(target_dir),
                              a.work / "load")  # fmt: skip
    measuring = sweep.Sweep(p.engine, p.bench, target_dir, export, prompts, a.work / "logs", load=sweeping)
    spent = restore_state(measuring, a.resume) if a.resume else {}
    record = {"engine": p.engine.name, "engine_flags": p.engine.extra_args, "dtype": p.bench.dtype,
              "depths": p.bench.depths, "concurrency": p.bench.concurrency, "prompts": len(prompts),
              "sets": p.bench.prompts, "max_tokens": p.bench.max_tokens, "drafter": a.drafter,
              "slo_itl_p90_ms": p.bench.slo_itl_p90_ms}  # fmt: skip

    def fits(name: str, factor: float = 1.0) -> bool:
        if a.budget_s is None:
            return True
        guess = factor * max(spent.values(), default=240.0)
        left = a.budget_s - (time.time() - started)
        if guess > left:
            print(f"[load_schedule] {name}: ~{guess:.0f} s, {left:.0f} s left of --budget-s: left for --resume")
            return False
        return True

    done = {r["config"] for r in measuring.rows} | {m["config"] for m in measuring.missing}
    stopped = False
    for depth in [None, *p.bench.depths]:
        name = engines.config_name(depth, p.bench.dtype)
        if name in done:
            continue
        if depth is not None and not measuring.baseline_outputs:
            raise SystemExit("the baseline was not measured: every depth is compared with it")
        if not fits(name):
            stopped = True
            break
        t0 = time.time()
        try:
            measuring.measure(depth, measuring.prompts)
        except engines.EngineError as e:  # recorded in `missing`; the other configurations go on
            print(f"[load_schedule] {name} failed: {str(e)[-2000:]}", flush=True)
            if depth is None:
                raise
        spent[name] = round(time.time() - t0, 1)
        save_state(measuring, a.state, spent)
    if not stopped and measuring.schedule is None and fits("the schedule", 1.3):
        t0 = time.time()
        measuring.deploy_schedule()
        spent["schedule"] = round(time.time() - t0, 1)
        save_state(measuring, a.state, spent)
    result = summary(measuring, spent, record)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    for r in result["load"] + result["sweep"]:
        print(json.dumps(r), flush=True)
    if result["schedule"] is not None:
        print(json.dumps({"kind": "schedule", **result["schedule"]}), flush=True)
    if result["against_fixed"] is not None:
        print(json.dumps({"kind": "against_fixed", **result["against_fixed"]}), flush=True)
    print(result["text"], flush=True)
    return 0


OUT_FILE = "summary.json"


def dry_run(work: Path) -> list[str]:
    return ["--prompts", "4", "--work", str(work), "--stand-in"]


def headline(rows: list[dict]) -> dict:
    """Per load, the schedule's tokens/s, its share of the best fixed configuration's and its p90 inter-token
    latency; over the loads, its mean against the best fixed mean; holds: 1 when the goal is met."""
    against = next((r for r in reversed(rows) if r.get("kind") == "against_fixed"), None)
    if against is None:
        return {}
    out = {}
    for point in against["points"]:
        c = point["load"].rsplit(", ", 1)[-1].split()[0]
        out[f"schedule_tokens_per_s_c{c}"] = round(point["schedule"], 1)
        out[f"schedule_over_best_fixed_c{c}"] = round(point["against_best"], 3)
        out[f"schedule_p90_itl_ms_c{c}"] = round(point["itl_p90_ms"], 2) if point["itl_p90_ms"] else None
    means = against["means"]
    out["schedule_mean_tokens_per_s"] = round(means.get("schedule", 0.0), 1)
    out["best_fixed_mean_tokens_per_s"] = round(max(v for k, v in means.items() if k != "schedule"), 1)
    out["holds"] = int(bool(against["holds"]))
    return {k: v for k, v in out.items() if v is not None}


if __name__ == "__main__":
    sys.exit(main())
