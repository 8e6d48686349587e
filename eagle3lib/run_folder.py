"""The run folder's stage folders and their result.json: what a stage reads from an earlier one and writes
for a later one (and for the pipeline, which adds hash, status and seconds; eagle3lib.workbook.pipeline).

outputs/<run>/NN_stage/result.json = {stage, figures, headline, artifacts}
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def stage_dir(run_dir: str | Path, stage: str) -> Path:
    """The stage's folder in the run folder, made if missing."""
    d = Path(run_dir) / stage
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_json(path: Path, obj) -> None:
    """Written whole or not at all: a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def save_result(
    run_dir: str | Path, stage: str, figures: dict, headline: dict | None = None, artifacts: list[str] | None = None
) -> dict:
    """Called by a stage notebook at its end: what it measured and what it made.

    headline: the few figures the run index shows; artifacts: paths (relative
    to the stage folder) whose absence makes the stage run again.
    """
    result = {"stage": stage, "figures": figures, "headline": headline or {}, "artifacts": artifacts or []}
    write_json(stage_dir(run_dir, stage) / "result.json", result)
    return result


def load_result(run_dir: str | Path, stage: str) -> dict:
    """An earlier stage's result; refuses one that did not finish."""
    path = Path(run_dir) / stage / "result.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: run stage {stage} first (python -m eagle3lib run PARAMS --only {stage})"
        )
    result = json.loads(path.read_text())
    if result.get("status", "ok") != "ok":
        raise RuntimeError(f"stage {stage} did not finish ({result.get('status')}: {result.get('error')}); rerun it")
    return result


def last_measured(output_root: str | Path, stage: str, key: str, match: dict) -> dict | None:
    """The newest figure `key` (dotted, e.g. "regenerate.tokens_per_s") of `stage` over every run folder in
    output_root whose figures agree with `match` ({dotted key: value}): {value, run, when}, or None where no
    finished run measured it. A plan's rate for the same target and backend on this machine."""
    best = None
    for path in Path(output_root).glob(f"*/{stage}/result.json"):
        try:
            figures = json.loads(path.read_text()).get("figures", {})
        except (OSError, ValueError):
            continue
        value = _dotted(figures, key)
        if not isinstance(value, (int, float)) or value <= 0:
            continue
        if any(_dotted(figures, k) != v for k, v in match.items()):
            continue
        when = path.stat().st_mtime
        if best is None or when > best["when"]:
            best = {"value": float(value), "run": path.parent.parent.name, "when": when}
    return best


def _dotted(d: dict, key: str):
    for part in key.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d
