"""The run folder's stage folders and their result.json: what a stage reads from an earlier one and writes
for a later one (and for the pipeline, which adds hash, status and seconds; eagle3lib.workbook.pipeline).

outputs/<run>/NN_stage/result.json = {stage, figures, headline, artifacts}
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import socket
import time
from pathlib import Path


def stage_dir(run_dir: str | Path, stage: str) -> Path:
    """The stage's folder in the run folder, made if missing."""
    d = Path(run_dir) / stage
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_json(path: Path, obj) -> None:
    """Written whole or not at all: a reader never sees half a file."""
    tmp = writer_tmp(path)
    try:
        tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def writer_tmp(path: Path) -> Path:
    """path's temporary name for this writer (this process), so that two writers never share one."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


# --------------------------------------------------------- what a stage made ----

# A made file up to this size is hashed when its stage ends and again before a run skips the stage, up to the
# stage's total below; beyond either, its size alone is checked (a Kimi run's states are terabytes).
HASHED_FILE_BYTES = 256 << 20
HASHED_STAGE_BYTES = 2 << 30


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def made_files(stage_path: Path) -> dict[str, dict]:
    """{path in the stage folder: {bytes, sha256 or None}} of every file the stage left there, less its own
    bookkeeping (result.json, the executed notebook, its report and log) and dot-files (temps, locks)."""
    stage = stage_path.name
    own = {"result.json", f"{stage}.ipynb", f"{stage}.html", f"{stage}.log"}
    files, hashed = {}, 0
    for path in sorted(p for p in stage_path.rglob("*") if p.is_file()):
        rel = path.relative_to(stage_path).as_posix()
        if rel in own or any(part.startswith(".") for part in Path(rel).parts):
            continue
        size = path.stat().st_size
        digest = None
        if size <= HASHED_FILE_BYTES and hashed + size <= HASHED_STAGE_BYTES:
            digest, hashed = file_digest(path), hashed + size
        files[rel] = {"bytes": size, "sha256": digest}
    return files


def changed_files(stage_path: Path, recorded: dict[str, dict]) -> list[str]:
    """Each recorded file that is missing, of another size or (where hashed) other bytes, as 'path: what'."""
    changed = []
    for rel, want in recorded.items():
        path = stage_path / rel
        if not path.is_file():
            changed.append(f"{rel}: missing")
        elif (size := path.stat().st_size) != want["bytes"]:
            changed.append(f"{rel}: {size} bytes, {want['bytes']} when made")
        elif want["sha256"] and file_digest(path) != want["sha256"]:
            changed.append(f"{rel}: other bytes than when made")
    return changed


# ------------------------------------------------------------------ lock ----

LOCK_FILE = "run.lock"


class RunFolderBusy(RuntimeError):
    """Another live process holds the run folder's lock; the message names it."""


@contextlib.contextmanager
def locked(run_dir: Path, command: str):
    """The run folder for this process alone while the block runs: its run.lock names the holder (pid, host, start
    time, command); a second run is refused with that in the message; the lock of a process that no longer
    exists on this host is taken over, with a warning."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command,
    }
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:  # flock: the kernel lets go of it when the holder dies, however it dies
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunFolderBusy(_busy_message(path, _holder(fd))) from None
        before = _holder(fd)
        if before and before.get("pid") != me["pid"]:
            logging.getLogger(__name__).warning(
                "%s: took over the lock of pid %s on %s (started %s), which no longer runs",
                path, before.get("pid"), before.get("host"), before.get("started"),
            )  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me, indent=2) + "\n").encode(), 0)
        os.fsync(fd)
        try:
            yield me
        finally:
            os.ftruncate(fd, 0)  # an empty lock file: nobody holds the folder
    finally:
        os.close(fd)  # releases the flock


def _holder(fd: int) -> dict:
    raw = os.pread(fd, 1 << 16, 0)
    try:
        return json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {}


def _busy_message(path: Path, holder: dict) -> str:
    if not holder:
        return f"{path}: another process holds this run folder (it has not written its name yet); try again"
    return (
        f"{path}: this run folder is in use by pid {holder.get('pid')} on {holder.get('host')}, started "
        f"{holder.get('started')} ({holder.get('command')}). Wait for it to finish or stop it "
        f"(kill {holder.get('pid')}), or give this run another folder (--set run.name=...)"
    )


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


def seconds_before(run_dir: str | Path, stage: str) -> float:
    """The seconds the run's stages before `stage` (NN_name folders, by their number) took, as their results say."""
    earlier = sorted(d.name for d in Path(run_dir).glob("[0-9][0-9]_*") if d.is_dir() and d.name < stage)
    return sum(float((read_result(run_dir, name) or {}).get("seconds") or 0) for name in earlier)


def read_result(run_dir: str | Path, stage: str) -> dict | None:
    """The stage's result.json, or None when it has none or one that does not read (emptied or torn by a full disk
    or a kill): such a stage counts as not run, so the next run makes it again, and a warning names the file."""
    path = Path(run_dir) / stage / "result.json"
    if not path.is_file():
        return None
    try:
        result = json.loads(path.read_text())
        if not isinstance(result, dict):
            raise ValueError(f"expected a JSON object, found {type(result).__name__}")
    except (OSError, ValueError) as e:
        logging.getLogger(__name__).warning("%s does not read (%s): stage %s counts as not run", path, e, stage)
        return None
    return result


def load_result(run_dir: str | Path, stage: str) -> dict:
    """An earlier stage's result; refuses one that did not finish."""
    path = Path(run_dir) / stage / "result.json"
    result = read_result(run_dir, stage)
    if result is None:
        why = "does not read" if path.is_file() else "not found"
        raise FileNotFoundError(
            f"{path} {why}: run stage {stage} first (python -m eagle3lib run PARAMS --only {stage})"
        )
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
