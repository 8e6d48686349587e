"""The cost model replayed on a finished benchmark: what it would have predicted for each measured depth.

Prints one JSON line per measured depth (predicted against measured). On a GPU host `python -m benchmarks
cost_model gpu-plan` runs the GPU recipe through 05_benchmark first (cost_model.sh).

The cost model replayed on a finished benchmark: what it would have predicted for each measured depth.

05_benchmark records the baseline, the in-process timings, the training eval's acceptance and every measured
row. This script feeds them back through bench.plan.choose_and_measure, with a stand-in sweep that returns
the recorded rows, so a change to speedup/cost.py can be judged against real engine measurements without
restarting an engine. Each depth is predicted by the model calibrated on the depths measured before it, as in
the live sweep; depths the new model plans but the run never measured are listed and skipped.

    python -m benchmarks cost_model benchmarks/results/cost_model/cpu-epyc-avx2-2c-2026-12-01

The folder holds 02_train_result.json and 05_benchmark_result.json (a run folder's stage result.json files,
or copies named so).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_script  # noqa: E402
from eagle3lib.params import BenchParams  # noqa: E402
from eagle3lib.speedup import plan  # noqa: E402


def result(folder: Path, stage: str) -> dict:
    for path in (folder / f"{stage}_result.json", folder / stage / "result.json"):
        if path.is_file():
            return json.loads(path.read_text())["figures"]
    raise FileNotFoundError(f"no {stage}_result.json or {stage}/result.json in {folder}")


class RecordedSweep:
    """A sweep (bench.sweep.Sweep) whose measure(depth, prompts, prediction, ...) is answered from the recorded
    rows: its rows start as the recorded baseline's."""

    def __init__(self, rows: list[dict]):
        self.recorded = rows
        self.prompts = [{}]  # one stand-in: the recorded rows answer for every prompt
        self.rows = [dict(r) for r in rows if r["depth"] == 0]
        self.missing: list[int] = []

    def say(self, line: str) -> None:
        pass

    def expect(self, configurations: int) -> None:
        pass

    def measure(self, depth, used, prediction=None, note="", calibration=False, concurrency=None):
        found = [
            dict(r)
            for r in self.recorded
            if r["depth"] == depth and r["concurrency"] in (concurrency or [r["concurrency"]])
        ]
        if not found:
            self.missing.append(depth)
        for r in found:
            r["predicted_speedup"] = prediction[(depth, r["concurrency"])]["speedup"]
        self.rows += found
        return found


def replay(folder: Path, tolerance: float = 0.15) -> dict:
    bench = result(folder, "05_benchmark")
    train = result(folder, "02_train")
    recorded = bench["cost_model"]["costs"]
    forward = {int(k): v for k, v in recorded["forward_ms"].items()}
    draft = {int(k): v for k, v in recorded["draft_ms"].items()}
    rows = bench["rows"]
    depths = sorted({r["depth"] for r in rows if r["depth"]})
    concurrency = sorted({r["concurrency"] for r in rows})
    params = BenchParams(depths=depths, concurrency=concurrency, max_depth=max(depths), quick_below=0.0)
    engine = RecordedSweep(rows)
    model = plan.choose_and_measure(engine, params, train["eval"], lambda: (forward, draft))
    table = []
    for r in engine.rows:
        if not r["depth"]:
            continue
        error = r["predicted_speedup"] / r["speedup"] - 1
        table.append(
            {
                "depth": r["depth"],
                "concurrency": r["concurrency"],
                "measured": round(r["speedup"], 3),
                "predicted": round(r["predicted_speedup"], 3),
                "error": round(error, 3),
                "within": abs(error) <= tolerance,
            }
        )
    return {"plan": model["plan"], "not_measured": engine.missing, "rows": table, "costs": model["costs"]}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu-plan"]:
        return gpu_script.plan_main("cost_model", argv[1:], PLANS, "gpu")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--tolerance", type=float, default=0.15)
    args = ap.parse_args(argv)
    out = replay(args.folder, args.tolerance)
    print(f"plan {out['plan']}; planned but never measured: {out['not_measured'] or 'none'}")
    print(f"{'depth':>5} {'conc':>4} {'measured':>9} {'predicted':>9} {'error':>7}")
    for r in out["rows"]:
        mark = "" if r["within"] else "  outside"
        print(
            f"{r['depth']:>5} {r['concurrency']:>4} {r['measured']:>9.2f} {r['predicted']:>9.2f} {r['error']:>+7.0%}{mark}"
        )
    inside = sum(r["within"] for r in out["rows"])
    print(f"within ±{args.tolerance:.0%}: {inside} of {len(out['rows'])}")
    overhead = {c: round(v, 1) for c, v in out["costs"]["overhead_ms"].items()}
    print(f"fitted overhead per speculative step (ms, per concurrency): {overhead}")
    for r in out["rows"]:
        print(json.dumps({k: v for k, v in r.items() if isinstance(v, (int, float, str, bool, type(None)))}))
    print(json.dumps({"within": inside, "depths_measured": len(out["rows"]), "overhead_ms": overhead}))


PLANS = {"gpu": ([], {})}


def dry_run(work: Path) -> list[str]:
    return [str(recorded_run())]


def headline(rows: list[dict]) -> dict:
    last = next((r for r in reversed(rows) if "within" in r and "depths_measured" in r), {})
    return {"depths within the tolerance": last.get("within"), "depths measured": last.get("depths_measured")}


def recorded_run() -> Path:
    """The recorded default CPU run whose 02_train and 05_benchmark results the dry run replays."""
    return ROOT / "benchmarks/results/cost_model/cpu-epyc-avx2-2c-2026-12-01"


if __name__ == "__main__":
    sys.exit(main())
