"""The engine's own interpreter: which one, the environment of its processes, and running our code in it: a script
of engines/engine_side (run_engine_side), or a module of eagle3lib that imports the engine (run_module).

The engines pin versions (transformers above all) that our .venv does not have, so engine code never runs
in this process: it runs in .venv-vllm / .venv-sglang (or engine.python), as a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

ENGINE_SIDE = Path(__file__).resolve().parent / "engine_side"
REPO = Path(__file__).resolve().parents[2]  # the folder that holds this eagle3lib package
LOG_TAIL_LINES = 40  # of a failed module's log, in its error


class InterpreterError(RuntimeError):
    """A process in an engine's interpreter failed; the message names its command, its exit status and the last of
    its output."""


def engine_python(engine: str, python=None) -> str | None:
    """Interpreter that has the engine: `python`, else .venv-<engine>/bin/python of this repo, else None."""
    if python:
        return str(python)
    local = REPO / f".venv-{engine}" / "bin" / "python"
    return str(local) if local.is_file() else None


# Every engine process, server or script: offline (the target and drafter are local folders by then), no
# tokenizer threads competing with the engine's, no OpenMP threads spinning on a shared CPU. These win over
# this process's environment; engine.env wins over them.
ENGINE_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
# GiB of KV cache for vLLM's CPU build where the environment does not say: the sequences here are short.
VLLM_CPU_KVCACHE_SPACE = "1"


def _with_pythonpath(env: dict, folders) -> dict:
    if folders:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, folders), *filter(None, [env.get("PYTHONPATH")])])
    return env


def engine_env(extra: dict | None = None, pythonpath=()) -> dict:
    """The whole environment of an engine subprocess: this process's, ENGINE_ENV, then `extra` (engine.env);
    `pythonpath` folders go before PYTHONPATH's."""
    env = {**os.environ, **ENGINE_ENV}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", VLLM_CPU_KVCACHE_SPACE)
    env.update(extra or {})
    return _with_pythonpath(env, pythonpath)


def module_env(extra: Mapping[str, str] | None = None) -> dict:
    """The whole environment of an eagle3lib module run in an engine's interpreter: this process's, then `extra`
    (engine.env), and this eagle3lib first on PYTHONPATH (that interpreter does not have it installed). No
    ENGINE_ENV: the module does a stage's own work, in the environment the stage has here."""
    return _with_pythonpath({**os.environ, **(extra or {})}, [REPO])


def command_text(cmd: Sequence[str]) -> str:
    return " ".join(map(str, cmd))


def run_engine_side(script: str, args: list[str], python: str, timeout: float = 600) -> dict:
    """Run engines/engine_side/<script> with `args` in the engine's interpreter; returns the JSON report it prints
    last (the scripts report an engine's refusal there too: a failure here means the script itself broke).
    Raises InterpreterError."""
    path = ENGINE_SIDE / script
    proc = subprocess.run([python, str(path), *args], capture_output=True, text=True, timeout=timeout, env=engine_env())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise InterpreterError(
            f"`{command_text([python, path.name, *args])}` failed (exit {proc.returncode}); "
            f"expected a JSON report. stderr tail:\n{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1])


def echo(line: str) -> None:
    """run_module's default line handler: the line on this process's stdout, as it comes."""
    print(line, end="", flush=True)


def run_module(
    python: str,
    module: str,
    args: Sequence[str],
    log: str | os.PathLike,
    *,
    env: Mapping[str, str] | None = None,
    on_line: Callable[[str], None] = echo,
    finished: Callable[[], bool] = lambda: True,
    failure: Callable[[int], str] | None = None,
    error: type[Exception] = InterpreterError,
) -> None:
    """Run `python -m module *args` (a module of eagle3lib, in an engine's interpreter) to its end: its stdout and
    stderr as one stream, every line written to `log` (flushed) and handed to on_line (echo prints it; a handler
    may parse, print or drop it). env: the whole environment, module_env() when None.

    Raises `error` (InterpreterError unless told) when the process exits non-zero, or exits 0 and finished() is
    False (what it should have made is missing): failure(exit status) opens the message (default "`python -m
    module` exited N"), then the command and the log's last 40 lines."""
    cmd = [str(python), "-m", module, *map(str, args)]
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    with (
        open(log, "w") as f,
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=module_env() if env is None else env
        ) as proc,
    ):
        for line in proc.stdout:
            f.write(line)
            f.flush()
            on_line(line)
        code = proc.wait()
    if code == 0 and finished():
        return
    opening = failure(code) if failure else f"`{python} -m {module}` exited {code}"
    with open(log, errors="replace") as f:
        tail = "".join(deque(f, maxlen=LOG_TAIL_LINES))
    raise error(f"{opening}; command: {command_text(cmd)}\nlast lines of {log}:\n{tail}")
