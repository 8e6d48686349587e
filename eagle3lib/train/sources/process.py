"""train.online_placement: process. One capture process runs the target and sends micro-batches to the trainers
(train.nproc_per_node of them: one process, or torchrun's workers) over a link of its own (sources/capture_link.py:
process groups made from a store the launcher holds, not the default group, and the wire, the credits, STOP and
ERROR). The trainers' default group spans the trainers alone (gradients are summed there, data parallel as ever);
the capture process's is left free, so that SGLang's model runner can make its tensor-parallel world there
(extract.backend sglang_inprocess, InEngineProcess: the capture process runs in SGLang's interpreter, the trainers
in this one).

The launcher holds the link's store and starts the capture process and the trainers together, each under a guard:
a kill -9 of the launcher ends them all, and when one fails the other is ended and the stage's error brings the
capture's log (02_train/capture.log). On GPUs the capture takes the first (SGLang's --tp ones), each trainer one
after them (CUDA_VISIBLE_DEVICES); on a host with fewer GPUs the two share them, the states through host
memory.

Beyond one host: train.online_placement: ray (sources/ray_actors.py) puts the same producer in a Ray actor and
the states in Ray's object store.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3lib import run_folder
from eagle3lib.engines.server import run_guarded_together
from eagle3lib.train import TrainingError
from eagle3lib.train.runtime.distributed import rank_and_world
from eagle3lib.train.sources import online
from eagle3lib.train.sources.base import TRAIN_ENTRY, OnlinePlacement, StageProcess, StageRun
from eagle3lib.train.sources.capture_link import (
    CAPTURE,
    LINK_ENV,
    ROLE_ENV,
    CaptureClient,
    Link,
    is_capture,
    link_env,
    open_store,
    serve_capture,
)

CAPTURE_LOG = "capture.log"  # under 02_train: the capture process's output
LOG_TAIL_LINES = 40  # of the capture's log, in the stage's error when it failed
# torchrun's variables: the launcher's own (a launcher started under torchrun) must not reach its processes
TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def log_tail(log: Path) -> str:
    if not log.is_file():
        return ""
    with open(log, errors="replace") as f:
        return "".join(deque(f, maxlen=LOG_TAIL_LINES))


@dataclass(frozen=True)
class GpuLayout:
    """The visible GPUs, the capture's count k, the trainers' n, and whether they share the first ones."""

    gpus: list[str]
    k: int
    n: int
    shared: bool


class CaptureProcess(OnlinePlacement):
    """A capture process beside train.nproc_per_node trainers (one process, or torchrun's workers), linked by
    process groups of their own."""

    name = "process"

    def launch(self, run: StageRun) -> dict:
        """The capture process and the trainers, started together under guards (none outlives the stage; when one
        fails the other is ended); the link's store is held here. Returns the first trainer's summary."""
        p, n = run.p, run.p.train.nproc_per_node
        store = open_store()
        capture_gpus, trainer_gpus = self.split_gpus(p)
        through_host = p.target.device.startswith("cuda") and self.gpu_layout(p).shared
        common = link_env(store, n, through_host) | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        trainers = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
        trainers = [*(trainers if n > 1 else [sys.executable]), "-m", TRAIN_ENTRY, *run.command_args()]
        # the capture's log is written as it comes (a large target's load is followed there)
        marked = {ROLE_ENV: CAPTURE, "PYTHONUNBUFFERED": "1"}
        capture, capture_env = self.capture_command(run, common | capture_gpus | marked)
        trainer_env = _without_torchrun({**os.environ, **common, **trainer_gpus})
        log = run_folder.stage_dir(run.run_dir, "02_train") / CAPTURE_LOG
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:
            codes = run_guarded_together(
                [
                    (capture, {"env": capture_env, "stdout": out, "stderr": subprocess.STDOUT}),
                    (trainers, {"env": trainer_env}),
                ]
            )
        if any(codes):
            raise TrainingError(
                f"online training with a capture process failed: the capture process exited {codes[0]}, the "
                f"trainers {codes[1]} (checkpoints already written are kept and resume); last lines of {log}:\n"
                f"{log_tail(log)}"
            )
        return run.summary()

    def capture_command(self, run: StageRun, env: dict) -> tuple[list[str], dict]:
        """(the capture process's command, its whole environment): this interpreter, the stage's entry point."""
        return [sys.executable, "-m", TRAIN_ENTRY, *run.command_args()], _without_torchrun({**os.environ, **env})

    def capture_gpus(self, p) -> int:
        """GPUs the capture process takes (the first ones; the trainers take the next)."""
        return 1

    def gpu_layout(self, p) -> GpuLayout:
        """Where the two sides run on this host's visible GPUs: each its own where there are enough (the capture's k
        first, one per trainer after them); where there are fewer, the capture on the first k and trainer t on the
        t-th, sharing them, and the states through host memory (NCCL makes no communicator of two processes on one
        GPU). Fewer GPUs than either side needs is refused."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        k, n = self.capture_gpus(p), p.train.nproc_per_node
        if len(gpus) < max(k, n):
            raise TrainingError(
                f"train.online_placement: {self.name} puts the capture on {k} GPU(s) and each of the {n} trainer(s) "
                f"on one, shared with the capture at most: {max(k, n)} GPUs, and {len(gpus)} are visible; lower "
                "train.nproc_per_node (or SGLang's --tp), or make more GPUs visible"
            )
        return GpuLayout(gpus, k, n, shared=len(gpus) < k + n)

    def split_gpus(self, p) -> tuple[dict, dict]:
        """(CUDA_VISIBLE_DEVICES of the capture process, of the trainers), {} each on the CPU: each side's own GPUs
        first (the capture's cuda:0.., trainer t's cuda:t), the other side's after them, visible so that NCCL can
        reach them peer to peer; on shared GPUs both see them in one order."""
        if not p.target.device.startswith("cuda"):
            return {}, {}
        layout = self.gpu_layout(p)
        if layout.shared:
            return ({"CUDA_VISIBLE_DEVICES": ",".join(layout.gpus)},) * 2
        capture, trainers = layout.gpus[: layout.k], layout.gpus[layout.k : layout.k + layout.n]
        return {"CUDA_VISIBLE_DEVICES": ",".join(capture + trainers)}, {
            "CUDA_VISIBLE_DEVICES": ",".join(trainers + capture)
        }

    def check_started(self, proc: StageProcess) -> None:
        if LINK_ENV not in os.environ:
            raise TrainingError(
                "train.online_placement: process runs a capture process beside the trainers: start the stage with "
                "launch.launch (the 02_train notebook does), or set train.online_placement: thread"
            )

    def serves_capture(self, proc: StageProcess) -> bool:
        if not is_capture():
            return False
        link = Link.join(0, proc.device)
        try:
            serve_capture(proc.p, Path(proc.run_dir), link)
        finally:
            link.close()
        return True

    def open(self, proc: StageProcess, tokens: dict) -> CaptureClient:
        contract = online.contract_without_weights(proc.p)
        rank, _ = rank_and_world()
        return CaptureClient(proc.p, contract, proc.device, Link.join(rank + 1, proc.device), first=rank == 0)

    def device_split(self, p) -> tuple[str, bool]:
        trainers = p.train.nproc_per_node
        if not p.target.device.startswith("cuda"):
            return f"the capture process and {trainers} trainer(s) share this CPU's cores (gloo)", True
        if self.shares_gpus(p):
            return f"the capture process and {trainers} trainer(s) share cuda:0 (states through host memory)", True
        return f"the capture process on cuda:0, {trainers} trainer(s) on cuda:1..{trainers} (NCCL)", False

    def shares_gpus(self, p) -> bool:
        """For the plan: whether the two sides share GPUs here (a host whose GPUs are not visible yet: own ones)."""
        try:
            return self.gpu_layout(p).shared
        except TrainingError:
            return False


def sglang_engine(p) -> dict:
    """engine_settings for the sglang_inprocess capture, whose interpreter must exist (a capture process or actor
    runs in it)."""
    from eagle3lib.extract.backends import engine_settings

    engine = engine_settings(p, "sglang")
    if engine["python"] is None:
        raise FileNotFoundError(
            "train.source: online with extract.backend sglang_inprocess captures in SGLang's interpreter and none "
            "was found: set engine.name: sglang and engine.python, or build .venv-sglang (make sglang-env)"
        )
    return engine


def engine_tp_gpus(p) -> int:
    """The GPUs SGLang's model runner takes as the capture: its --tp (engine.extra_args), 1 without one."""
    from eagle3lib.engines.sglang import tp_size
    from eagle3lib.extract.backends import engine_settings

    return tp_size(engine_settings(p, "sglang")["extra_args"])


def _without_torchrun(env: dict) -> dict:
    return {k: v for k, v in env.items() if k not in TORCHRUN_VARS}


class InEngineProcess(CaptureProcess):
    """The process placement with SGLang's model runner as the capture (extract.backend sglang_inprocess): the
    capture process runs in SGLang's interpreter (engine.python, else .venv-sglang), its tensor-parallel ranks on
    the first GPUs (its default group is theirs); the trainers run in this interpreter, on the GPUs after them."""

    name = "process (sglang_inprocess)"

    def capture_command(self, run: StageRun, env: dict) -> tuple[list[str], dict]:
        from eagle3lib.engines.interpreter import module_env

        engine = sglang_engine(run.p)
        command = [engine["python"], "-m", TRAIN_ENTRY, *run.command_args()]
        return command, _without_torchrun(module_env({**engine["env"], **env}))

    def capture_gpus(self, p) -> int:
        return engine_tp_gpus(p)

    def device_split(self, p) -> tuple[str, bool]:
        k, n = self.capture_gpus(p), p.train.nproc_per_node
        if self.shares_gpus(p):
            return (
                f"SGLang's model runner in a capture process (SGLang's interpreter) on cuda:0..{k - 1}, {n} trainer(s) "
                f"on cuda:0..{n - 1}, sharing them (states through host memory)",
                True,
            )
        return (
            f"SGLang's model runner in a capture process (SGLang's interpreter) on cuda:0..{k - 1}, {n} trainer(s) "
            f"on cuda:{k}..{k + n - 1} (NCCL, or gloo through host memory when the two torch builds' NCCL differ)",
            False,
        )
