"""Durable writes: every file of an extraction goes to a temp name, is fsynced and renamed over its path, so a
run killed at any point leaves a file whole or absent."""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path, chunks):
    """Write bytes chunks to a temp name in the same folder, fsync, rename over path, fsync
    the folder. Returns (sha256 hex, bytes written). Each chunk is hashed in a thread while it is written
    (both release the GIL)."""
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")  # this writer's own: another's is never cut short
    h, n = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as f, ThreadPoolExecutor(1) as hasher:
            for chunk in chunks:
                hashed = hasher.submit(h.update, chunk)
                f.write(chunk)
                hashed.result()
                n += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception:
        if os.path.exists(tmp):  # a write cut short (a full disk): its space back at once, not at the next run
            os.unlink(tmp)
        raise
    _fsync_dir(folder)
    return h.hexdigest(), n


def write_json(path, obj):
    """obj as indented JSON, written atomically."""
    atomic_write(path, [(json.dumps(obj, indent=1) + "\n").encode()])
