"""Ends what a local Ray cluster leaves behind when the process that started it dies without ray.shutdown (kill -9,
the OOM killer): Ray 2.60's GCS, raylet and actors follow their driver, but its DashboardAgent and RuntimeEnvAgent
were seen running a minute later, reparented to init.

    python ray_reaper.py DRIVER_PID RAY_TEMP_DIR

Started by ray_actors.start_local in a session of its own, for a cluster started with RAY_TEMP_DIR of its own as
Ray's temp dir: every process of that cluster holds files open there (its logs, its sockets), which is how they are
found (Ray's processes rename themselves, overwriting their command line and environment). When the driver is gone
it sends SIGTERM to each, SIGKILL after a grace period, and exits. Stdlib only.
"""

import os
import signal
import sys
import time

GRACE_S = 5.0


def holding(folder: str) -> list[int]:
    """Pids of the running processes (this one aside) with a file open under folder."""
    folder = os.path.realpath(folder) + os.sep
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
            if any(os.readlink(f"/proc/{name}/fd/{fd}").startswith(folder) for fd in fds):
                pids.append(int(name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def end(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def main() -> int:
    driver, folder = int(sys.argv[1]), sys.argv[2]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while os.getppid() == driver:
        time.sleep(0.5)
    end(holding(folder), signal.SIGTERM)
    deadline = time.time() + GRACE_S
    while time.time() < deadline and holding(folder):
        time.sleep(0.2)
    end(holding(folder), signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
