"""sha256 of a drafter folder's files, recorded when it is written and checked when it is read: a changed byte in
the weights would otherwise load as other weights without a word."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3lib.run_folder import file_digest

DIGESTS_FILE = "sha256.json"  # {file: sha256} of the folder's other files, written last


class DamagedFolderError(ValueError):
    """A file of a drafter folder no longer matches the sha256 recorded when it was written."""


def record_digests(folder: Path) -> None:
    """Write sha256.json for every file now in the folder (after the folder's last write)."""
    folder = Path(folder)
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.name != DIGESTS_FILE)
    (folder / DIGESTS_FILE).write_text(json.dumps({f.name: file_digest(f) for f in files}, indent=2) + "\n")


def damage(folder: Path) -> str | None:
    """What is wrong with the folder against its sha256.json, naming the file; None when every file it lists
    matches, or when it has none (a folder written before digests were recorded, or by another tool)."""
    folder = Path(folder)
    listed = folder / DIGESTS_FILE
    if not listed.is_file():
        return None
    try:
        digests = json.loads(listed.read_text())
    except (OSError, ValueError) as e:
        return f"{listed} cannot be read ({e})"
    for name, digest in sorted(digests.items()):
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if file_digest(path) != digest:
            return f"{path} does not match its sha256 in {DIGESTS_FILE} (changed or damaged since it was written)"
    return None


def check_digests(folder: Path) -> None:
    """Raise DamagedFolderError, naming the file, when the folder's files do not match their digests."""
    wrong = damage(folder)
    if wrong:
        raise DamagedFolderError(
            f"{wrong}: train the drafter again (02_train), or put back a copy of the folder; a file changed on "
            f"purpose needs its digest in {DIGESTS_FILE} written again (eagle3lib.drafter.digests.record_digests)"
        )
