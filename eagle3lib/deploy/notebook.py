"""The 04_deploy stage around one server: that its whole process group is gone after stop(), and the stage's
result (the server, its smoke request, its log)."""

from __future__ import annotations

from eagle3lib import engines

SMOKE_FIGURES = ("completion_tokens", "tokens_per_s", "tpot_ms", "accept_len", "per_pos", "drafts")


def check_stopped(server) -> list[int]:
    """The server's process group after stop(): no process may survive it (an engine's workers hold its memory
    and port). Returns the survivors, that is none; raises naming them."""
    left = engines.alive_in_group(server.group)
    if left:
        raise RuntimeError(
            f"engine processes {left} survived stop(); expected none. Kill them: kill {' '.join(map(str, left))}"
        )
    return left


def result(
    server, smoke: dict, engine: str, depth: int, dtype: str | None, left: list[int], served_by: dict[int, str]
) -> dict:
    """For Stage.save: the server (ready time, url, command, log, the processes that served: {pid: start time},
    engines.process_starts, for anyone to look up after the stage) and its smoke request (configuration.measure at
    concurrency 1) as figures, the index's headline, the log as the artifact."""
    log = server.log_path.name
    figures = {
        "engine": engine,
        "depth": depth,
        "dtype": dtype,
        "ready_s": server.ready_s,
        "url": server.url,
        "command": server.command,
        "log": log,
        "logs": [log],
        "left_processes": left,
        "group": server.group,
        "served_by": {str(pid): start for pid, start in served_by.items()},
        "smoke": {k: smoke[k] for k in SMOKE_FIGURES} | {"text": smoke["outputs"][0]["text"]},
    }
    headline = {
        "ready": f"{server.ready_s} s",
        "smoke tokens/s": round(smoke["tokens_per_s"], 1),
        "acceptance length": smoke["accept_len"] and round(smoke["accept_len"], 3),
    }
    return {"figures": figures, "headline": headline, "artifacts": [log]}
