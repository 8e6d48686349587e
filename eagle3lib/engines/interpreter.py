"""The engine's own interpreter: which one, the environment of its processes, and running a script of
engines/inside in it.

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


# Every engine process, server or script: offline (the target and drafter are local folders by then), no
# tokenizer threads competing with the engine's, no OpenMP threads spinning on a shared CPU. These win over
# this process's environment; engine.env wins over them.
ENGINE_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
# GiB of KV cache for vLLM's CPU build where the environment does not say: the sequences here are short.
VLLM_CPU_KVCACHE_SPACE = "1"


def engine_env(extra: dict | None = None, pythonpath=()) -> dict:
    """The whole environment of an engine subprocess: this process's, ENGINE_ENV, then `extra` (engine.env);
    `pythonpath` folders go before PYTHONPATH's."""
    env = {**os.environ, **ENGINE_ENV}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", VLLM_CPU_KVCACHE_SPACE)
    env.update(extra or {})
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_inside(script: str, args: list[str], python: str, timeout: float = 600) -> dict:
    """Run engines/inside/<script> with `args` in the engine's interpreter; returns the JSON report it prints
    last (the scripts report an engine's refusal there too: a failure here means the script itself broke)."""
    path = INSIDE / script
    proc = subprocess.run([python, str(path), *args], capture_output=True, text=True, timeout=timeout, env=engine_env())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"`{python} {path.name} {' '.join(args)}` failed (exit {proc.returncode}); "
            f"expected a JSON report. stderr tail:\n{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1])
