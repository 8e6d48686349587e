"""An engine server as a subprocess: port, start, health wait, log, HTTP, stop.

The server runs under engines/guard.py, which leads its own process group: stop() ends the whole
group (the engine's worker processes included), and the guard ends it by itself when the Python
process that started it dies without running stop() (kill -9, a crashed kernel). Servers still
running at interpreter exit are stopped by an atexit hook; a `with` block stops on errors and Ctrl-C.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path

from eagle3lib.engines.interpreter import engine_env

GUARD = Path(__file__).resolve().parent / "guard.py"
_RUNNING: set = set()


class EngineError(RuntimeError):
    """The engine did not start, answer or stop as expected; the message carries the log tail."""


# A request's limit before anything was measured (the warm-up itself); then size_request_timeout's
FIRST_REQUEST_TIMEOUT_S = 600


def request_timeout_s(seconds_per_token: float, max_tokens: int, concurrency: int) -> float:
    """A request's limit from the decode speed measured on this server: 10x what max_tokens take with
    `concurrency` requests sharing it, plus a minute for the prompt, at most FIRST_REQUEST_TIMEOUT_S. A hung
    engine then ends the measurement in about that, not in 600 s a request."""
    return round(min(FIRST_REQUEST_TIMEOUT_S, 60 + 10 * seconds_per_token * max_tokens * max(1, concurrency)), 1)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(host: str, port: int) -> None:
    """Raise EngineError when host:port cannot be bound (another server holds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # as the engines' servers bind (uvicorn sets it): connections left in TIME_WAIT by a stopped engine do
        # not keep the next one off its port, a listener still does
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise EngineError(
                f"Expected port {port} on {host} to be free for the engine, found it taken ({e.strerror}). "
                f"Stop whatever listens there (`ss -ltnp | grep :{port}`), or set engine.port to another "
                "port or to null for a free one."
            ) from None


def log_tail(path, lines: int = 40) -> str:
    path = Path(path)
    if not path.is_file():
        return "(no log written)"
    with open(path, errors="replace") as f:
        return "".join(deque(f, maxlen=lines))


def http_json(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    """GET (body None) or POST JSON; returns the decoded answer. HTTP errors carry the server's message."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise EngineError(
            f"{url} answered HTTP {e.code}, expected 200: {e.read().decode(errors='replace')[:2000]}"
        ) from None


def http_text(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class Server:
    """One engine process. Subclasses (engines.vllm.VLLM, engines.sglang.SGLang) add complete() and stats().

    command: the launch command without host/port flags (the subclass adds them);
    env: variables over engine_env's (engine.env); log_path: stdout+stderr of the server.
    """

    name = "engine"
    context_flag: str | None = None  # the launch flag that limits the served context (subclasses)
    health_path = "/health"

    def __init__(
        self,
        command: list[str],
        log_path,
        host: str = "127.0.0.1",
        port: int | None = None,
        env: dict | None = None,
        start_timeout_s: float = 600,
    ):
        self.host = host
        self.port_asked = port
        self.port = port
        self.base_command = list(command)
        self.env = dict(env or {})
        self.log_path = Path(log_path)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.group: int | None = None  # process group id of the last start (the guard's pid)
        self.request_timeout_s: float = FIRST_REQUEST_TIMEOUT_S  # complete()'s limit a request
        self.ready_s: float | None = None

    # -- subclasses -----------------------------------------------------------------------
    def address_args(self, host: str, port: int) -> list[str]:
        return ["--host", host, "--port", str(port)]

    def complete(self, prompt_ids: list[int], sampling: dict) -> dict:
        """One completion request in the engine's own API. sampling: {temperature, top_p, max_tokens, ignore_eos,
        stop_token_ids (when given)}. Returns {token_ids, text, completion_tokens, finish_reason, meta}."""
        raise NotImplementedError(f"{type(self).__name__} does not serve completions")

    def preflight(self) -> None:
        """Checks before the launch, once the port is settled: raise EngineError to refuse it (subclasses)."""

    # -- requests -------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        ignore_eos: bool = True,
        stop_token_ids: list[int] | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
    ) -> dict:
        """Completion of token ids, greedy unless temperature > 0 (then sampled, with speculation by the engine's
        rejection sampling): {token_ids, text, completion_tokens, seconds, finish_reason, meta}."""
        sampling = {
            "temperature": float(temperature),
            "top_p": float(top_p),
            "max_tokens": max_tokens,
            "ignore_eos": ignore_eos,
        }
        if stop_token_ids:
            sampling["stop_token_ids"] = list(stop_token_ids)
        t0 = time.perf_counter()
        with self.answering():
            out = self.complete(prompt_ids, sampling)
        return {**out, "seconds": time.perf_counter() - t0}

    @contextlib.contextmanager
    def answering(self):
        """Around any request to the running engine (a completion, its metrics): one that gets no answer raises
        EngineError with failure_text, not the socket's bare error."""
        try:
            yield
        except (OSError, http.client.HTTPException) as e:  # refused, reset, closed without an answer, timed out
            raise EngineError(self.failure_text(e)) from None

    def failure_text(self, error: Exception) -> str:
        """What a request that got no answer says: the engine, whether it still runs (else its exit status), the
        error and its log's last lines."""
        timed_out = isinstance(error, TimeoutError) or "timed out" in str(error)
        code, deadline = None, time.time() + (0 if timed_out else 3)  # the guard sees its engine's exit in 0.25 s
        while self.proc is not None and (code := self.proc.poll()) is None and time.time() < deadline:
            time.sleep(0.1)
        if code is not None:
            state = f"exited with status {code}"
        elif timed_out:
            state = f"still runs but did not answer within {self.request_timeout_s:.0f} s (hung)"
        else:
            state = "still runs but closed the connection"
        return (
            f"{self.name} at {self.url} {state} while it served a request ({type(error).__name__}: {error}). "
            f"Last lines of {self.log_path}:\n{log_tail(self.log_path)}"
        )

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> list[str]:
        return self.base_command + self.address_args(self.host, self.port or 0)

    def start(self) -> float:
        """Launch and wait until healthy; returns seconds to ready. Raises EngineError with the log tail."""
        if self.proc is not None:
            raise EngineError(f"{self.name} is already running (pid {self.proc.pid}); stop() it first.")
        if self.port_asked is None:
            self.port = free_port(self.host)
        else:
            check_port(self.host, self.port_asked)
        self.preflight()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        log.write(f"$ {' '.join(self.command)}\n".encode())
        log.flush()
        t0 = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, str(GUARD), str(os.getpid()), *self.command],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=engine_env(self.env),
            start_new_session=True,
        )
        log.close()
        self.group = self.proc.pid
        _RUNNING.add(self)
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.ready_s = round(time.time() - t0, 1)
        return self.ready_s

    def _wait_healthy(self, t0: float) -> None:
        while True:
            code = self.proc.poll()
            if code is not None:
                raise EngineError(
                    f"{self.name} exited with status {code} during start, expected it to serve "
                    f"{self.url}. Last lines of {self.log_path}:\n{log_tail(self.log_path)}"
                )
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.time() - t0 > self.start_timeout_s:
                raise EngineError(
                    f"{self.name} was not healthy at {self.url}{self.health_path} after "
                    f"{self.start_timeout_s:.0f} s (engine.start_timeout_s); stopped it. Last lines of "
                    f"{self.log_path}:\n{log_tail(self.log_path)}"
                )
            time.sleep(0.5)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 20) -> None:
        """SIGTERM to the whole process group, SIGKILL after grace_s; waits until no member is left."""
        if self.proc is None:
            return
        stop_group(self.proc, grace_s)
        self.proc = None
        _RUNNING.discard(self)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)


def stop_group(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """End the process group that proc (a guard) leads: SIGTERM, SIGKILL after grace_s; waits until no member is
    left."""
    group = proc.pid
    try:
        os.killpg(group, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.time() + grace_s
    while time.time() < deadline and alive_in_group(group):
        proc.poll()
        time.sleep(0.2)
    if alive_in_group(group):
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    for _ in range(50):  # SIGKILL is not instant
        if not alive_in_group(group):
            break
        time.sleep(0.1)


def run_guarded(cmd: list[str], grace_s: float = 20, **popen) -> None:
    """Run cmd to its end under guard.py, in a process group of its own: ended with this process however it dies
    (kill -9 included), and on an exception here (Ctrl-C: KeyboardInterrupt) with SIGTERM to the group first, so
    that a launcher (torchrun) stops its own workers, which lead sessions of their own. Raises
    subprocess.CalledProcessError for a non-zero exit, as subprocess.run(check=True) does."""
    proc = subprocess.Popen([sys.executable, str(GUARD), str(os.getpid()), *cmd], start_new_session=True, **popen)
    try:
        code = proc.wait()
    except BaseException:
        stop_group(proc, grace_s)
        raise
    if code:
        raise subprocess.CalledProcessError(code, cmd)


def run_guarded_together(commands: list[tuple[list[str], dict]], grace_s: float = 20) -> list[int]:
    """Run several (cmd, Popen keywords) at once, each under guard.py as run_guarded runs one; when one exits
    non-zero the others' groups are ended (SIGTERM, then SIGKILL after grace_s), as they are on an exception here.
    Returns the exit statuses, in order (a command ended for another's failure: the status it ended with)."""
    procs = []
    try:
        for cmd, popen in commands:
            guarded = [sys.executable, str(GUARD), str(os.getpid()), *cmd]
            procs.append(subprocess.Popen(guarded, start_new_session=True, **popen))
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            time.sleep(0.2)
    except BaseException:
        for p in procs:
            stop_group(p, grace_s)
        raise
    for p in procs:
        if p.poll() is None:
            stop_group(p, grace_s)
    return [p.returncode for p in procs]


def still_runs(pid: int) -> bool:
    """Whether the process runs: not gone, not a zombie (an exited process waiting for its reaper holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def alive_in_group(group: int) -> list[int]:
    """Pids of the group's processes that still run."""
    return [pid for pid in group_members(group) if still_runs(pid)]


def process_starts(pids: list[int]) -> dict[int, str]:
    """{pid: its start time in clock ticks since boot (/proc/PID/stat)} of those that run: a pid with its start
    time names one process, whatever reuses the pid later."""
    starts = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                starts[pid] = f.read().rsplit(")", 1)[1].split()[19]
        except (OSError, IndexError):
            continue
    return starts


def group_members(group: int) -> list[int]:
    """Pids whose process group is `group` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == group:
                found.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return found


@atexit.register
def _stop_all() -> None:
    for server in list(_RUNNING):
        server.stop(grace_s=5)
