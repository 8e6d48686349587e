"""Ctrl-C, SIGTERM and SIGHUP during a run: the running stage's kernel interrupted first, as Ctrl-C in a notebook,
then the run stopped (Interrupted)."""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
import time

from eagle3lib.workbook import kernels

# After Ctrl-C the running stage has this long to stop as a notebook does on Ctrl-C (its engines stopped, what it
# measured kept) before papermill kills its kernel
INTERRUPT_GRACE_S = 8.0


class Interrupted(KeyboardInterrupt):
    """The run was stopped by Ctrl-C, SIGTERM or SIGHUP."""


@contextlib.contextmanager
def stop_on_signals(grace_s: float = INTERRUPT_GRACE_S):
    """Ctrl-C (SIGINT), SIGTERM and SIGHUP stop the run, also where the shell that started it ignores SIGINT (a
    background job). The first interrupts the running stage's kernel: its cell stops as on Ctrl-C in a notebook;
    a second signal, or grace_s without the stage ending, raises Interrupted here at once (papermill then kills the
    kernel; guarded children end with it). Between stages the first raises at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    first: list[float] = []
    timers: list[threading.Timer] = []

    def handler(signum, _frame):
        running = [k for k in list(kernels.KERNELS) if getattr(k.provisioner, "pid", None) and k.has_kernel]
        if first or not running:
            raise Interrupted(f"stopped by {signal.Signals(signum).name}")
        first.append(time.time())
        print(
            f"[eagle3] {signal.Signals(signum).name}: stopping the running stage (again to stop at once)",
            file=sys.stderr,
        )
        for kernel in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(kernel.provisioner.pid, signal.SIGINT)
        timer = threading.Timer(grace_s, _thread.interrupt_main)
        timer.daemon = True
        timer.start()
        timers.append(timer)

    saved = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield first
    finally:
        for timer in timers:
            timer.cancel()
        for sig, before in saved.items():
            signal.signal(sig, before)
