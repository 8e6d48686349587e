"""A vLLM CPU server or capture is refused, before it launches, on cores another vLLM's worker is pinned to: two
workers on one core starve each other (on 2 cores the second server was not healthy after 600 s). The running
worker here is a real process that looks to /proc as vLLM's does: titled VLLM::Worker, allowed fewer CPUs than its
parent."""

import os
import subprocess
import sys
import time

import pytest
import torch

from eagle3lib import engines
from eagle3lib.engines import EngineError
from eagle3lib.engines import vllm as engine_vllm
from eagle3lib.extract.vllm import VLLMCapture
from eagle3lib.params import EngineParams

PINNED_WORKER = """
import os, sys, time
open("/proc/self/comm", "w").write("VLLM::Worker")  # vLLM's title of its worker process
os.sched_setaffinity(0, {int(sys.argv[1])})
print("pinned", flush=True)
time.sleep(600)
"""


def test_cpu_lists_read_as_the_kernel_writes_them():
    assert engine_vllm.cpu_list("0-3,5") == {0, 1, 2, 3, 5}
    assert engine_vllm.cpu_list("7\n") == {7}
    assert engine_vllm.cpu_list("") == set()
    assert engine_vllm.cores_to_bind({"VLLM_CPU_OMP_THREADS_BIND": "0-1|4"}) == {0, 1, 4}
    assert engine_vllm.cores_to_bind({"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) == set()
    assert engine_vllm.cores_to_bind({}) == set(os.sched_getaffinity(0))


@pytest.fixture
def pinned_worker():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"needs 2 CPUs to pin a worker to fewer than its parent's; this process may use {cores}")
    proc = subprocess.Popen([sys.executable, "-c", PINNED_WORKER, str(cores[0])], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "pinned"
        yield proc.pid, cores
    finally:
        proc.kill()
        proc.wait()


def test_a_second_vllm_is_refused_on_the_cores_a_running_worker_holds(pinned_worker, embedded_cache, tmp_path):
    pid, cores = pinned_worker
    found = [w for w in engine_vllm.pinned_vllm_workers() if w["pid"] == pid]
    assert found == [
        {"pid": pid, "cores": {cores[0]}, "server_pid": os.getpid(), "server": " ".join(map(str, sys.orig_argv))}
    ]
    server = engines.make(EngineParams(), tmp_path / "target", None, None, tmp_path)
    with pytest.raises(EngineError, match=rf"pid {pid} on cores \[{cores[0]}\], started by pid {os.getpid()}"):
        server.start()
    assert server.proc is None and not server.log_path.exists()  # refused before the launch
    # the extraction's vLLM: refused the same way, nothing left in its folder
    _, target_dir = embedded_cache
    tok = {"input_ids": torch.arange(8), "seq_starts": torch.tensor([0, 4, 8])}
    with pytest.raises(EngineError, match=rf"pid {pid} on cores"):
        VLLMCapture(target_dir, [2, 15, 27]).measure_plain_prefill(tok, [0, 1], 1, tmp_path / "capture")
    assert list((tmp_path / "capture").iterdir()) == []
    # cores of its own, or none pinned: allowed
    engine_vllm.check_cores_free({"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores[1:]))})
    engine_vllm.check_cores_free({"VLLM_CPU_OMP_THREADS_BIND": "nobind"})


def test_a_worker_allowed_its_parents_cpus_is_not_pinned(tmp_path):
    """A GPU worker (or VLLM_CPU_OMP_THREADS_BIND=nobind) keeps its parent's CPUs: no refusal."""
    script = PINNED_WORKER.replace("os.sched_setaffinity(0, {int(sys.argv[1])})", "")
    proc = subprocess.Popen([sys.executable, "-c", script, "0"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "pinned"
        assert proc.pid not in [w["pid"] for w in engine_vllm.pinned_vllm_workers()]
    finally:
        proc.kill()
        proc.wait()


def test_a_worker_that_exited_holds_no_core(tmp_path):
    """A stopped server's worker can stay a zombie a while (reparented to an init that reaps late): not counted."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"needs 2 CPUs to pin a worker to fewer than its parent's; this process may use {cores}")
    script = PINNED_WORKER.replace("time.sleep(600)", "")
    proc = subprocess.Popen([sys.executable, "-c", script, str(cores[0])], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "pinned"
        for _ in range(100):  # exited, not yet reaped: this test's process is its parent and has not waited
            if open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.05)
        assert open(f"/proc/{proc.pid}/comm").read().strip() == "VLLM::Worker"
        assert proc.pid not in [w["pid"] for w in engine_vllm.pinned_vllm_workers()]
        engine_vllm.check_cores_free({})
    finally:
        proc.wait()
