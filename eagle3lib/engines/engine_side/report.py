"""The one JSON line an engine-side script answers with (engines.interpreter.run_engine_side reads the last line of
its stdout): its verdict, or the refusal when the engine could not build or load what it was given. Standard
library only, so that every engine's interpreter can import it."""

from __future__ import annotations

import json
import sys

NO_COUNTS = {"expected": 0, "loaded": 0, "skipped": 0, "missing": 0, "extra": 0}


def refusal(engine: str, why: str, error: BaseException, **fields) -> dict:
    """A report that the engine refused: `why` with the error's type and words; nothing counted as loaded."""
    return {"engine": engine, "ok": False, **fields, "problems": [f"{why}: {type(error).__name__}: {error}"],
            "counts": dict(NO_COUNTS)}  # fmt: skip


def answer(report: dict) -> int:
    """Print the report as the script's last stdout line, after whatever the engine printed."""
    sys.stdout.flush()
    print(json.dumps(report, default=str), flush=True)
    return 0
