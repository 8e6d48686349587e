"""Keeps an engine server from outliving the Python process that started it.

    python guard.py PARENT_PID COMMAND...

Started by engines.base.Server as the leader of a new process group (session). It runs COMMAND in
that group and waits. When COMMAND exits, it exits with the same status. When PARENT_PID dies
(kill -9, a crashed kernel: no finally block runs), or it gets SIGTERM/SIGINT/SIGHUP, it terminates
the whole group: SIGTERM, then SIGKILL after a grace period. Stdlib only: any interpreter runs it.
"""

import os
import signal
import subprocess
import sys
import time

GRACE_S = 15.0


def _kill_group(child) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM reaches the guard too
    group = os.getpgid(0)
    try:
        os.killpg(group, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + GRACE_S
    while time.time() < deadline and child.poll() is None:
        time.sleep(0.2)
    time.sleep(0.5)  # the engine's own children shut down after it
    os.killpg(group, signal.SIGKILL)  # whatever is left, the guard included


def main() -> int:
    parent, cmd = int(sys.argv[1]), sys.argv[2:]
    child = subprocess.Popen(cmd)  # same process group as the guard
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.append(1))
    while True:
        code = child.poll()
        if code is not None:
            if code < 0:  # killed by a signal: die of the same one, so that our parent reads the same status
                if -code != signal.SIGKILL:  # SIGKILL has no handler to reset
                    signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            return code
        if stop or os.getppid() != parent:
            _kill_group(child)
            return 1
        time.sleep(0.25)


if __name__ == "__main__":
    sys.exit(main())
