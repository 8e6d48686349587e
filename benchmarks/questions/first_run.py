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
    print(json.dumps(row))
    return row


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
    return {"total_minutes": last.get("total_minutes"), **(last.get("headline") or {})}


if __name__ == "__main__":
    sys.exit(main())
