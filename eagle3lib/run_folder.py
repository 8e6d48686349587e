"""The run folder's stage folders and their result.json: what a stage reads from an earlier one and writes
for a later one (and for the pipeline, which adds hash, status and seconds; eagle3lib.workbook.pipeline).

outputs/<run>/NN_stage/result.json = {stage, figures, headline, artifacts}
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path


def stage_dir(run_dir: str | Path, stage: str) -> Path:
    """The stage's folder in the run folder, made if missing."""
    d = Path(run_dir) / stage
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_json(path: Path, obj) -> None:
    """Written whole or not at all: a reader never sees half a file (write_text)."""
    write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def write_text(path: str | Path, text: str) -> None:
    """Written whole or not at all, through a temp name renamed over path: a reader never sees half a file, a full
    disk leaves the earlier file as it was, and its error names path (writing)."""
    path = Path(path)
    tmp = writer_tmp(path)
    try:
        with writing(path):
            tmp.write_text(text)
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # a half-written temp would hold the space a full disk needs back


DISK_FULL_ADVICE = (
    "free space (df -h) or set run.output_root on another disk, then run again: finished stages are kept, and this "
    "stage's finished files (shards, checkpoints)"
)


def is_disk_full(e: BaseException | str) -> bool:
    """Whether an error (or its text) is a full disk's: ENOSPC, or safetensors' 'os error 28' that has no errno."""
    text = str(e)
    return getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in text or "os error 28" in text


@contextlib.contextmanager
def writing(path: str | Path):
    """Errors of writing path named by it: an OSError without a file name (a write's own names none) and a full
    disk that torch or safetensors reports in words are raised as OSError(errno, message, path)."""
    try:
        yield
    except OSError as e:
        if e.filename is not None and e.errno != errno.ENOSPC:  # a full disk's: path, not the temp written
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
    except Exception as e:
        if not is_disk_full(e):
            raise
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from e


def disk_full_text(error: str, where: Path) -> str | None:
    """'the disk is full while writing PATH: advice' when an error's text says the disk was full (PATH: the file
    its OSError names, else the folder `where`), or when `where` has under 1 MiB free (torch's words for a
    full disk do not say so); None otherwise."""
    named = re.search(r"\[Errno 28\] [^:]+: '(.+?)'", error)
    try:
        full = is_disk_full(error) or shutil.disk_usage(where).free < 1 << 20
    except OSError:
        full = is_disk_full(error)
    if not full:
        return None
    return f"the disk is full while writing {named.group(1) if named else f'in {where}'}: {DISK_FULL_ADVICE}"


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
# Set by the pipeline for the stage kernels it starts (workbook/kernels.py): the pid, host and start of the run.lock
# it holds and the folder, so their open_stage writes under its lock; open_stage believes it only where run.lock
# names that same holder, the lock is held and the holder is an ancestor of the kernel
HOLDER_ENV = "EAGLE3_RUN_LOCK_HOLDER"
_HELD: dict[Path, dict] = {}  # the run folders this process holds (resolved): their run.lock contents
_HELD_FOR_LIFE = contextlib.ExitStack()  # hold_while_alive's locks, let go when the process exits
atexit.register(_HELD_FOR_LIFE.close)


class RunFolderBusy(RuntimeError):
    """Another live process holds the run folder's lock; the message names it."""


@contextlib.contextmanager
def locked(run_dir: Path, command: str, kernel: bool = False):
    """The run folder for this process alone while the block runs: its run.lock names the holder (pid, host, start
    time, command; kernel: a notebook's kernel opened by hand); a second run is refused with that in the message; the
    lock of a process that no longer exists on this host is taken over, with a warning. Within this process the
    lock is reentrant: a block on a folder the process holds already yields that holder."""
    run_dir.mkdir(parents=True, exist_ok=True)
    key = run_dir.resolve()
    if key in _HELD:
        yield _HELD[key]
        return
    path = run_dir / LOCK_FILE
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command,
        **({"kernel": True} if kernel else {}),
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
        _HELD[key] = me
        try:
            yield me
        finally:
            del _HELD[key]
            os.ftruncate(fd, 0)  # an empty lock file: nobody holds the folder
    finally:
        os.close(fd)  # releases the flock


def holder_env(run_dir: str | Path) -> dict[str, str]:
    """HOLDER_ENV for the kernels this process starts on run_dir while it holds the folder; {} where it does not."""
    key = Path(run_dir).resolve()
    me = _HELD.get(key)
    if me is None:
        return {}
    return {HOLDER_ENV: json.dumps({"run_dir": str(key), **{k: me[k] for k in ("pid", "host", "started")}})}


def hold_while_alive(run_dir: str | Path, command: str, kernel: bool = False) -> dict:
    """run_dir's lock for the rest of this process's life (a notebook's kernel: let go when it exits), unless it is
    held already by this process or by the one that started it (the pipeline, for its stage kernels: HOLDER_ENV);
    RunFolderBusy, naming the holder, where another process holds it. Returns the holder, with 'by': 'this
    process', 'the process that started this one' or 'taken now'."""
    run_dir = Path(run_dir)
    if (parent := _held_by_ancestor(run_dir)) is not None:
        return {**parent, "by": "the process that started this one"}
    if (mine := _HELD.get(run_dir.resolve())) is not None:
        return {**mine, "by": "this process"}
    return {**_HELD_FOR_LIFE.enter_context(locked(run_dir, command, kernel)), "by": "taken now"}


def _held_by_ancestor(run_dir: Path) -> dict | None:
    """run.lock's holder where HOLDER_ENV names this folder and run.lock's holder, the lock is held now, and its
    pid is this process's parent or an ancestor of it; None otherwise (no variable, or a stale or forged one)."""
    try:
        told = json.loads(os.environ.get(HOLDER_ENV) or "{}")
    except ValueError:
        return None
    if not isinstance(told, dict) or told.get("run_dir") != str(run_dir.resolve()):
        return None
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None  # nobody holds it: the variable outlived its holder
        except BlockingIOError:
            holder = _holder(fd)
    finally:
        os.close(fd)
    same = all(holder.get(k) == told.get(k) for k in ("pid", "host", "started"))
    if not same or holder.get("host") != socket.gethostname() or not _is_ancestor(holder.get("pid")):
        return None
    return holder


def _is_ancestor(pid) -> bool:
    """Whether pid is this process's parent, or the parent's parent and so on (/proc where there is one)."""
    if not isinstance(pid, int) or pid <= 1:
        return False
    here = os.getppid()
    for _ in range(64):
        if here == pid:
            return True
        try:  # /proc/<pid>/stat: "pid (name) state ppid ..."; the name may hold spaces and parentheses
            here = int(Path(f"/proc/{here}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if here <= 1:
            return False
    return False


def _holder(fd: int) -> dict:
    raw = os.pread(fd, 1 << 16, 0)
    try:
        return json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {}


def _busy_message(path: Path, holder: dict) -> str:
    if not holder:
        return f"{path}: another process holds this run folder (it has not written its name yet); try again"
    pid = holder.get("pid")
    if holder.get("kernel"):
        who = f"a notebook's kernel, pid {pid}"
        advice = f"Shut that kernel down (JupyterLab: Kernel > Shut Down Kernel) or stop it (kill {pid})"
    else:
        who, advice = f"pid {pid}", f"Wait for it to finish or stop it (kill {pid})"
    return (
        f"{path}: this run folder is in use by {who} on {holder.get('host')}, started {holder.get('started')} "
        f"({holder.get('command')}). {advice}, or give this run another folder (--set run.name=... on the command "
        "line, overrides={'run.name': ...} in a notebook's parameters cell)"
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
