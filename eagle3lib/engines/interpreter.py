"""The engine's own interpreter: which one, and running a script of engines/inside in it.

The engines pin versions (transformers above all) that our .venv does not have, so engine code never runs
in this process: it runs in .venv-vllm / .venv-sglang (or engine.python), as a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

INSIDE = Path(__file__).resolve().parent / "inside"


def engine_python(engine: str, python=None) -> str | None:
    """Interpreter that has the engine: `python`, else .venv-<engine>/bin/python of this repo, else None."""
    if python:
        return str(python)
    local = Path(__file__).resolve().parents[2] / f".venv-{engine}" / "bin" / "python"
    return str(local) if local.is_file() else None


def run_engine_check(args: list[str], python: str, timeout: float = 600) -> dict:
    """Run eagle3lib/engines/inside/load_check.py in the engine's interpreter; returns its JSON report."""
    script = INSIDE / "load_check.py"
    env = dict(
        os.environ,
        OMP_WAIT_POLICY="PASSIVE",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    )
    proc = subprocess.run([python, str(script), *args], capture_output=True, text=True, timeout=timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"engine check `{python} {script.name} {' '.join(args)}` failed (exit {proc.returncode}); "
            f"expected a JSON report. stderr tail:\n{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1])
