"""Served AL of several drafters in one engine, beside the offline prediction, with 95% intervals of their ratios.

Writes summary.json (rows per drafter, depth and set; ratios with --base) and prints its tables.

Served acceptance of several drafters in one engine, beside our offline prediction of each: the same target,
prompts, depths and greedy decoding at batch size 1 for every drafter, so that two trainers' drafters compare.

    python benchmarks/questions/served_al RUN_DIR --params params/smollm2-135m-gpu.yaml \
        --drafter ours=RUN_DIR/02_train/drafter --drafter speculators=DIR --drafter specforge=DIR \
        --depths 3,5 --sets held_out,mt_bench,humaneval,../shared/benchsets/gsm8k/question.jsonl \
        --per-set 20 --out summary.json

A drafter is any checkpoint `convert` reads (ours, speculators, EAGLE/SpecForge `midlayer.*`); each is imported
into the canonical form against the run's target (`--target` semantics), exported for the params' engine, and
served at every depth (top-k 1, depth + 1 draft tokens). Every (drafter, depth) gets its own server, one after
the other (--parallel N runs N at once, each sending its prompts one at a time: concurrency between servers
changes their speed, not their acceptance; SGLang sizes its memory from the GPU's total, so on one GPU several
need --mem-fraction small enough for all). RUN_DIR needs a finished
00_prepare (held-out prompts). Predicted AL: the target's states on each served reply (prompt + the engine's own
tokens), the drafter's TTT evaluation (bench.predict, train.ttt_steps steps, extrapolated past them), per set.
Offline AL, for every drafter that imports (served or not: SGLang 0.5.17 cannot serve norm_before_residual):
our trainer's own evaluation (loop.evaluate: TTT over the run's validation rows, estimated AL per depth), the
one metric every trainer's drafter is measured by here. Servers run in the target's dtype (--dtype; SGLang 0.5.17
feeds the target's states to the draft's fc uncast, so a draft in another dtype than the target fails).
A drafter's NAME is TRAINER[:CONFIG[:SEED]] (e.g. ours:defaults:1). Rows: {trainer, config, seed, budget, depth,
set, served_al, predicted_al, prompts, requests, completion_tokens, per_prompt: [[id, tokens, accept_len], ...]}
+ --meta NAME=JSON, and set "val" rows with offline_al; with --base TRAINER:CONFIG, "ratios": every other
configuration's served AL over the base's, with 95% intervals (benchmarks/al_interval.py). OUT is rewritten after
every step, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import eagle3lib  # noqa: F401  (OMP_WAIT_POLICY before torch)
from benchmarks import al_interval, gpu_script
from eagle3lib import engines, target
from eagle3lib.convert import layouts
from eagle3lib.params import cache_dir, load_params
from eagle3lib.prepare.conversations import load_bench_prompts
from eagle3lib.speedup import measurement, predict
from eagle3lib.speedup import notebook as speedup_notebook
from eagle3lib.train.runtime.checkpoint import load_drafter

MEM_FLAG = "--mem-fraction-static"


def named(items: list[str], what: str) -> dict[str, str]:
    """['a=x', 'b=y'] -> {'a': 'x', 'b': 'y'}, refusing a malformed or repeated name."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise SystemExit(f"--{what} {item!r}: expected NAME=VALUE")
        if name in out:
            raise SystemExit(f"--{what} {name!r} given twice")
        out[name] = value
    return out


def parse_name(name: str) -> dict:
    """'trainer:config:seed' -> {trainer, config, seed}; config defaults to 'defaults', seed to None."""
    parts = name.split(":")
    if len(parts) > 3 or (len(parts) == 3 and not parts[2].isdigit()):
        raise SystemExit(f"drafter name {name!r}: expected TRAINER[:CONFIG[:SEED]] with an integer SEED")
    return {"trainer": parts[0], "config": parts[1] if len(parts) > 1 else "defaults",
            "seed": int(parts[2]) if len(parts) == 3 else None}  # fmt: skip


def per_prompt(engine: str, m: dict) -> list[list]:
    """[[prompt id, completion tokens, accept length], ...] of one set's requests (concurrency 1): what a paired
    bootstrap over prompts resamples."""
    out = []
    for req in m.get("requests", []):
        al = measurement.spec_over(engine, req["parts"]).get("accept_len")
        out.append([req["id"], req["completion_tokens"], al])
    return out


def engine_args(extra_args: list[str], mem_fraction: float | None) -> list[str]:
    """The params' engine flags with the memory fraction replaced (several servers share one GPU)."""
    args = list(extra_args)
    if mem_fraction is None:
        return args
    if MEM_FLAG in args:
        i = args.index(MEM_FLAG)
        del args[i : i + 2]
    return args + [MEM_FLAG, str(mem_fraction)]


def prepare_drafters(drafters: dict[str, str], target_dir: str, cache, engine: str, work: Path) -> dict[str, dict]:
    """{name: {source, canonical, export, error}}: each checkpoint imported against the target and exported for
    the engine; what fails is recorded (a drafter the engine cannot serve keeps its offline figures)."""
    out = {}
    for name, src in drafters.items():
        info = out[name] = {"source": str(src), "canonical": None, "export": None, "error": None}
        try:
            info["canonical"] = str(layouts.import_checkpoint(src, work / name / "canonical", target=target_dir,
                                                              cache_dir=cache))  # fmt: skip
            info["export"] = str(layouts.export(info["canonical"], engine, work / name / engine, target=target_dir,
                                                cache_dir=cache))  # fmt: skip
        except (ValueError, FileNotFoundError) as e:
            info["error"] = f"{type(e).__name__}: {e}"
        print(f"{name}: {src} -> {info['export'] or info['error']}", flush=True)
    return out


def offline_al(p, run_dir: Path, canonical: str, steps: int) -> dict:
    """Our trainer's validation of a drafter (any trainer's, imported): {depth: estimated AL}, step_acc, cond_acc."""
    from eagle3lib.train import loop
    from eagle3lib.train.runtime.setup import build_setup

    setup, _ = build_setup(p, run_dir, p.target.device)
    setup.drafter = load_drafter(Path(canonical), device=p.target.device)
    # build_setup leaves the target's embedding and head on the host; train() moves them to its device, as here
    setup.embed, setup.head = setup.embed.to(p.target.device), setup.head.to(p.target.device)
    summary = loop.evaluate(setup, steps, steps, p.target.device)
    return {
        "accept_len_at": {int(d): v for d, v in summary["est_accept_len"].items()},
        "step_acc": summary["step_acc"],
        "cond_acc": summary["cond_acc"],
        "positions": summary.get("positions"),
    }


def serve_all(
    p, target_dir, drafters: dict, depths: list[int], prompts_by_set: dict, max_tokens: int, work: Path, parallel: int,
    dtype: str | None, done=lambda results, errors: None,
):  # fmt: skip
    """{(name, depth): {set: measure_set's result}}, `parallel` servers at a time; ({...}, {(name, depth): error}).
    done(results, errors) after each server."""
    results, errors = {}, {}
    # One server starts at a time; the others serve meanwhile. SGLang measures the free memory before it loads and
    # again after, and picks its NCCL port by checking it is free, then binding it later: a server that allocated
    # its KV cache in between made the other fail ("Raise --mem-fraction-static above 0.202"; EADDRINUSE on that
    # port), each failure a retry of a minute or more. Servers that start beside running
    # ones started fine in every run.
    starting = threading.Lock()

    def one(name: str, depth: int):
        server = None
        try:
            (work / name / "logs").mkdir(parents=True, exist_ok=True)
            export = drafters[name]["export"]
            server = engines.make(p.engine, target_dir, export, depth, work / name / "logs", dtype=dtype)
            with starting:
                server.start()
            by_set = {}
            for set_name, prompts in prompts_by_set.items():
                by_set[set_name] = measurement.measure_set(server, prompts, max_tokens, 1, {})
            results[(name, depth)] = by_set
            spec = {s: measurement.spec_over(p.engine.name, m["parts"]).get("accept_len") for s, m in by_set.items()}
            print(f"{name} depth {depth}: served AL {json.dumps(spec)}", flush=True)
        except Exception as e:  # one failing server must not hide the others' figures
            errors[(name, depth)] = f"{type(e).__name__}: {e}"
            print(f"{name} depth {depth}: FAILED {errors[(name, depth)][-3000:]}", flush=True)
        finally:
            if server is not None:
                server.stop()
        done(results, errors)

    servable = [(n, d) for n in drafters if drafters[n]["export"] for d in depths]
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        list(pool.map(lambda nd: one(*nd), servable))
    # A server that still failed beside others: once more, alone on the device.
    if parallel > 1:
        for name, depth in [nd for nd in servable if nd in errors]:
            print(f"{name} depth {depth}: once more, alone", flush=True)
            del errors[(name, depth)]
            one(name, depth)
    return results, errors


def predicted_per_set(p, target_dir, cache, canonical: str, measured: dict, max_depth: int) -> dict:
    """{set: {depth: predicted AL}} of one drafter on served replies (one server's: greedy, they are the target's
    whatever the depth and drafter)."""
    model, _ = target.load_target(target_dir, cache, dtype=p.target.dtype, device=p.target.device)
    drafter = load_drafter(Path(canonical), device=p.target.device)
    sequences = [
        {"id": pr["id"], "set": set_name, "prompt_ids": pr["prompt_ids"], "token_ids": out["token_ids"]}
        for set_name, m in measured.items()
        for pr, out in zip(m["prompts"], m["outputs"])
        if out.get("token_ids")
    ]
    per_set = predict.predict_per_set(
        model, drafter, sequences, drafter.cfg.aux_layer_ids, max_depth, p.train.ttt_steps, p.target.device
    )
    del model, drafter
    return {s: {int(d): v for d, v in summary["accept_len_at"].items()} for s, summary in per_set.items()}


def rows_of(
    results: dict, predicted: dict, offline: dict, depths: list[int], meta: dict, engine: str, budget: str = "tokens"
) -> list[dict]:
    """One row per drafter x depth x served set, and per drafter x depth the offline AL on validation (set 'val')."""
    rows = []
    for name, figures in sorted(offline.items()):
        for depth in depths:
            rows.append(
                {
                    **parse_name(name),
                    "budget": budget,
                    "depth": depth,
                    "set": "val",
                    "served_al": None,
                    "offline_al": figures["accept_len_at"].get(depth),
                    **meta.get(name, {}),
                }
            )
    for (name, depth), by_set in sorted(results.items()):
        for set_name, m in by_set.items():
            spec = measurement.spec_over(engine, m["parts"])
            rows.append(
                {
                    **parse_name(name),
                    "budget": budget,
                    "depth": depth,
                    "set": set_name,
                    "served_al": spec.get("accept_len"),
                    "predicted_al": (predicted.get(name, {}).get(set_name) or {}).get(depth),
                    "prompts": len(m["outputs"]),
                    "requests": len(m["outputs"]),
                    "completion_tokens": sum(o["completion_tokens"] or 0 for o in m["outputs"]),
                    "per_prompt": per_prompt(engine, m),
                    **meta.get(name, {}),
                }
            )
    return rows


def mean_over_sets(rows: list[dict]) -> list[dict]:
    """Each drafter (trainer x config x seed) x depth: the mean of the sets' served and predicted AL (the means over
    seeds, with intervals, are al_interval's)."""
    groups = {}
    for r in rows:
        if r["set"] != "val":
            groups.setdefault((r["trainer"], r["config"], r.get("seed"), r["depth"]), []).append(r)
    out = []
    for (trainer, config, seed, depth), group in sorted(groups.items(), key=lambda kv: str(kv[0])):
        served = [r["served_al"] for r in group if r["served_al"] is not None]
        pred = [r["predicted_al"] for r in group if r["predicted_al"] is not None]
        out.append(
            {
                "trainer": trainer,
                "config": config,
                "seed": seed,
                "depth": depth,
                "sets": len(group),
                "served_al_mean": sum(served) / len(served) if served else None,
                "predicted_al_mean": sum(pred) / len(pred) if pred else None,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="a run folder with a finished 00_prepare")
    ap.add_argument("--params", required=True, help="the run's params file (target, engine, bench)")
    ap.add_argument("--drafter", action="append", default=[], help="NAME=CHECKPOINT, NAME = TRAINER[:CONFIG[:SEED]]")
    ap.add_argument("--budget", choices=["tokens", "gpu_minutes"], default="tokens",
                    help="what the trainers were given equally (recorded in every row)")  # fmt: skip
    ap.add_argument("--base", default=None, help="TRAINER:CONFIG the others' ratios are taken against")
    ap.add_argument("--meta", action="append", default=[], help="NAME=JSON file merged into that drafter's rows")
    ap.add_argument("--depths", default="3,5")
    ap.add_argument("--sets", default="held_out,mt_bench,humaneval")
    ap.add_argument("--per-set", type=int, default=20, help="questions per set (first turns)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per reply (default: bench.max_tokens)")
    ap.add_argument("--mem-fraction", type=float, default=None, help="each server's share of the GPU's memory")
    ap.add_argument("--parallel", type=int, default=1, help="servers at a time")
    ap.add_argument("--engine-flag", action="append", default=[], help="an extra engine flag (repeatable)")
    ap.add_argument("--no-predict", action="store_true", help="served AL only")
    ap.add_argument("--offline-only", action="store_true", help="no engine: the offline AL of every drafter")
    ap.add_argument("--no-offline", action="store_true", help="no offline AL (RUN_DIR then needs only 00_prepare)")
    ap.add_argument("--dtype", default=None, help="the engine's dtype for target and drafter (default: target.dtype)")
    ap.add_argument("--work", type=Path, default=None, help="exports and logs (default: OUT's folder/served)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stand-in", action="store_true", help="check the options, run nothing (dry run)")
    a = ap.parse_args(argv)
    if a.stand_in:
        return gpu_script.skip(
            "serving: each drafter's engine server (SGLang on a GPU) and the offline evaluation of a run's 02_train"
        )

    drafters = named(a.drafter, "drafter")
    if not drafters:
        ap.error("give at least one --drafter NAME=CHECKPOINT")
    for name in drafters:
        parse_name(name)
    meta = {n: json.loads(Path(f).read_text()) for n, f in named(a.meta, "meta").items()}
    depths = [int(d) for d in a.depths.split(",")]
    sets = [s.strip() for s in a.sets.split(",") if s.strip()]
    p = load_params(a.params, {"bench.prompts": sets, "bench.num_prompts": a.per_set, "bench.context_lengths": []})
    p.engine.extra_args = engine_args(p.engine.extra_args, a.mem_fraction) + a.engine_flag
    cache = cache_dir(p)
    target_dir = target.resolve_target(p.target.name, cache)
    by_set = {}
    if not a.offline_only:
        tokenizer = target.load_tokenizer(target_dir, p.target.trust_remote_code)
        held_out = load_bench_prompts(a.run_dir / "00_prepare" / "bench.jsonl")
        for pr in speedup_notebook.bench_prompts(p, tokenizer, held_out):
            if pr.get("turn", 1) == 1:
                by_set.setdefault(pr["set"], []).append(pr)
        print({s: len(v) for s, v in by_set.items()}, flush=True)
    max_tokens = a.max_tokens or p.bench.max_tokens

    work = a.work or a.out.parent / "served"
    prepared = prepare_drafters(drafters, target_dir, cache, p.engine.name, work)
    summary = {
        "what": "served AL per set (batch size 1, greedy, top-k 1), our offline predicted AL beside it, and every "
        "drafter's AL by our trainer's validation (set 'val'), one engine",
        "engine": p.engine.name,
        "target": str(target_dir),
        "sets": {s: len(v) for s, v in by_set.items()},
        "max_tokens": max_tokens,
        "drafters": prepared,
    }
    results, errors, predicted, offline = {}, {}, {}, {}
    predict_errors = {}  # drafter: why its prediction failed (its served figures stand)

    def write():
        rows = rows_of(results, predicted, offline, depths, meta, p.engine.name, a.budget)
        failed = {f"{n}@{d}": e for (n, d), e in errors.items()} | {
            f"{n}@predict": e for n, e in predict_errors.items()
        }
        summary.update(errors=failed, means=mean_over_sets(rows), rows=rows)
        if a.base:
            summary["ratios"] = al_interval.ratios(rows, a.base)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(summary, indent=2, default=str))

    for name, info in prepared.items():
        if info["canonical"] and not a.no_offline:
            offline[name] = offline_al(p, a.run_dir, info["canonical"], max(depths))
            print(f"{name}: offline AL {json.dumps(offline[name]['accept_len_at'])}", flush=True)
            write()
    if not a.offline_only:
        predicting = threading.Lock()

        def predict(name: str, measured: dict):
            # in a server's thread: a failure here must not end the other servers
            try:
                predicted[name] = predicted_per_set(
                    p, target_dir, cache, prepared[name]["canonical"], measured, max(depths)
                )
            except Exception as e:
                predicted[name], predict_errors[name] = {}, f"{type(e).__name__}: {e}"
                print(f"{name}: prediction FAILED {predict_errors[name][-2000:]}", flush=True)

        def done(r, e):
            # called by each server's thread when it ends
            with predicting:
                results.update(r)
                errors.clear()  # serve_all's own: a server that failed beside others, then served alone, is no error
                errors.update(e)
                for by in results.values():
                    for set_name, m in by.items():
                        m["prompts"], m["engine"] = by_set[set_name], p.engine.name
                # a drafter's prediction as soon as one of its servers has served (the greedy replies are the
                # target's, whatever the depth), so that a call cut short keeps the predictions of those served
                if not a.no_predict:
                    for name, depth in sorted(results):
                        if prepared[name]["canonical"] and name not in predicted:
                            predict(name, results[(name, depth)])
                write()

        dtype = a.dtype or p.target.dtype
        serve_all(p, target_dir, prepared, depths, by_set, max_tokens, work, a.parallel, dtype, done)
        if not a.no_predict and results:
            reference = results[max(results)]  # greedy replies are the target's, whichever drafter served them
            for name, info in prepared.items():
                if info["canonical"] and name not in predicted:  # none of its servers served
                    predict(name, reference)
                    write()
    write()
    for m in summary["means"]:
        print(json.dumps(m), flush=True)
    if a.base:
        print(al_interval.table(summary["ratios"]), flush=True)
    return 1 if errors or predict_errors else 0


OUT_FILE = "summary.json"


def dry_run(work: Path) -> list[str]:
    return [str(work / "run"), "--params", "params/smollm2-135m-gpu.yaml", "--drafter",
            "shipped=drafters/smollm2-135m-instruct", "--stand-in"]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
