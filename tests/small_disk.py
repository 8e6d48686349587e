"""A small disk for tests of a full one: a tmpfs mounted for the test (root only: the test is skipped elsewhere) and
a filler file that takes every free byte of it, as another writer would."""

import errno
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest


def mount_tmpfs(folder: Path, megabytes: int) -> Path:
    """A tmpfs of that size at folder; skips the test where this user may not mount one."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(
            f"a small disk for the test needs `mount -t tmpfs` (root): {done.stderr.strip() or done.returncode}"
        )
    return folder


def unmount(folder: Path) -> None:
    subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path) -> Path:
    """A filler file in folder taking every free byte of its disk."""
    filler = folder / f"filler-{uuid.uuid4().hex[:8]}"
    block = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as f:
        while True:
            try:
                f.write(block)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                if len(block) == 1:
                    return filler
                block = block[: len(block) // 2]


def fill_when(folder: Path, ready) -> dict:
    """Fills folder's disk (fill) from a thread as soon as ready() is true: {'filler': its path} once filled,
    'thread' to join."""
    filled = {}

    def watch():
        deadline = time.monotonic() + 600
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.02)
        filled["filler"] = fill(folder)

    filled["thread"] = threading.Thread(target=watch, daemon=True)
    filled["thread"].start()
    return filled


def says(path: Path, text: str):
    """A ready() for fill_when: path exists and holds text."""

    def ready() -> bool:
        try:
            return text in path.read_text(errors="replace")
        except OSError:
            return False

    return ready
