"""A fresh clone's `make run` on a CPU: each stage's time, the measured speedup and the recommendation.

Runs `python -m eagle3lib run PARAMS` (default params/smollm2-135m-cpu.yaml, what `make run` runs) into --run-root,
or reads a finished run (--run-dir), and prints one JSON line per stage (its status and seconds) and one of the
headline: total minutes, the best measured speedup and the recommended configuration (05_benchmark's headline).

    python -m benchmarks first_run                          # the whole run (about an hour on 2 cores)
    python -m benchmarks first_run --run-dir outputs/tiny   # a finished run, read only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("00_prepare", "01_extract", "02_train", "03_convert", "04_deploy", "05_benchmark")


def stage_result(run: Path, stage: str) -> dict | None:
    for path in (run / stage / "result.json", run / f"{stage}_result.json"):
        if path.is_file():
            return json.loads(path.read_text())
    return None


def seconds(result: dict) -> float | None:
    for key in ("wall_s", "seconds", "elapsed_s", "duration_s"):
        if isinstance(result.get(key), (int, float)):
            return result[key]
    return None


def summarise(run: Path) -> dict:
    total, found = 0.0, 0
    for stage in STAGES:
        result = stage_result(run, stage)
        if result is None:
            continue
        found += 1
        s = seconds(result)
        total += s or 0
        print(json.dumps({"stage": stage, "status": result.get("status"), "seconds": s}))
    bench = stage_result(run, "05_benchmark") or {}
    row = {"stages": found, "total_minutes": round(total / 60, 1), "headline": bench.get("headline")}
    row["figures"] = bench_figures(bench.get("figures") or {})
    print(json.dumps(row))
    return row


def bench_figures(figures: dict) -> dict:
    """The benchmark's numbers a result cites: the recommendation at each concurrency (speedup, acceptance length,
    p90 inter-token latency under load) and the depth schedule against the fixed configurations under load."""
    out = {}
    rows = figures.get("rows") or []
    for c, rec in (figures.get("recommendation") or {}).items():
        out[f"speedup_c{c}"] = rec["speedup"]
        out[f"acceptance_length_c{c}"] = rec.get("accept_len") and round(rec["accept_len"], 3)
        here = [r for r in rows if str(r["concurrency"]) == c]
        mine = next((r for r in here if r["config"] == rec["config"]), {})
        base = next((r for r in here if r["config"].startswith("baseline")), {})
        out[f"p90_itl_ms_c{c}"] = mine.get("p90_itl_ms") and round(mine["p90_itl_ms"], 1)
        out[f"baseline_p90_itl_ms_c{c}"] = base.get("p90_itl_ms") and round(base["p90_itl_ms"], 1)
    against = figures.get("schedule_against_fixed") or {}
    means = against.get("means") or {}
    if "schedule" in means:
        out["schedule_mean_tokens_per_s"] = round(means["schedule"], 2)
        out["best_fixed_mean_tokens_per_s"] = round(max(v for k, v in means.items() if k != "schedule"), 2)
        out["schedule_min_against_best"] = round(min(p["against_best"] for p in against["points"]), 3)
    return {k: v for k, v in out.items() if v is not None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params/smollm2-135m-cpu.yaml")
    ap.add_argument("--run-dir", type=Path, default=None, help="a finished run to read instead of running one")
    ap.add_argument("--run-root", type=Path, default=None, help="where the run goes (default: a temp folder)")
    args = ap.parse_args(argv)
    run = args.run_dir
    if run is None:
        root = args.run_root or Path(tempfile.mkdtemp(prefix="first-run-"))
        cmd = [sys.executable, "-m", "eagle3lib", "run", args.params, "--set", f"run.output_root={root}"]
        code = subprocess.call(cmd, cwd=ROOT)
        runs = [p for p in root.iterdir() if p.is_dir()]
        if code != 0 or len(runs) != 1:
            print(f"the run exited {code}; run folders: {runs}", file=sys.stderr)
            return code or 1
        run = runs[0]
    return 0 if summarise(run)["stages"] else 1


def dry_run(work: Path) -> list[str]:
    """The run itself takes an hour: the dry run reads the recorded default run's stage results instead."""
    from benchmarks.questions.cost_model import recorded_run

    print(json.dumps({"skipped": "the run itself (about an hour on 2 cores): the recorded default run read instead"}))
    return ["--run-dir", str(recorded_run())]


def headline(rows: list[dict]) -> dict:
    last = next((r for r in reversed(rows) if "total_minutes" in r), {})
    return {"stages_minutes": last.get("total_minutes"), **(last.get("figures") or {})}


if __name__ == "__main__":
    sys.exit(main())
