"""Data parallel training: under torchrun each rank takes its share of every step's micro-batches and the
gradients are summed over ranks; one process is a world of one."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from eagle3lib.train import TrainingError
from eagle3lib.train.checkpoint import weights_digest

# The trainer ranks' group when the world also holds a capture process (train.online_placement: process, rank 0
# captures); None: every rank trains.
_trainers = None
# Whether this process's default group is the trainers' (joined by init_process_group below). With extract.backend
# sglang_inprocess online, SGLang's model runner makes the default group of its tensor-parallel ranks instead: the
# one trainer then trains alone and leaves that group to SGLang.
_joined = False


def split_capture_rank() -> bool:
    """In a world of one capture process (rank 0) and trainers (ranks 1..N): make the trainers' group, which
    gradients are summed over (every rank calls this, as torch.distributed.new_group wants), and return whether
    this rank is the capture process."""
    global _trainers
    group = dist.new_group(list(range(1, dist.get_world_size())))
    if dist.get_rank() > 0:
        _trainers = group
    return dist.get_rank() == 0


def training_group():
    """The group the trainers' collectives run over (None: the default, every rank)."""
    return _trainers


def rank_and_world() -> tuple[int, int]:
    """(this process's rank among the trainers, number of trainers); (0, 1) outside torchrun."""
    if trainers_joined():
        return dist.get_rank(_trainers), dist.get_world_size(_trainers)
    return 0, 1


def trainers_joined() -> bool:
    """Whether this process trains in a process group of trainers (and capture ranks) it joined."""
    return _joined and dist.is_available() and dist.is_initialized()


def init_process_group(device: str) -> str:
    """Join torchrun's process group when WORLD_SIZE > 1 (NCCL on CUDA, gloo elsewhere); returns the device
    this rank trains on (its LOCAL_RANK's GPU under NCCL)."""
    global _joined
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(device)
        dist.init_process_group(backend)
        _joined = True
    return device


def all_reduce_grads(params: list, world: int) -> None:
    """Sum the gradients over ranks (data parallel); all requests in flight at once."""
    if world <= 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for work in [dist.all_reduce(p.grad, group=_trainers, async_op=True) for p in params]:
        work.wait()


def check_same_weights(module: torch.nn.Module, world: int) -> list[str]:
    """Each rank's weights_digest of the module, after training: data parallel must leave every rank with the
    same weights, and a TrainingError says when it did not."""
    if world <= 1:
        return [weights_digest(module)]
    digests = [None] * world
    dist.all_gather_object(digests, weights_digest(module), group=_trainers)
    if len(set(digests)) != 1:
        raise TrainingError(f"ranks hold different weights after training: {digests}")
    return digests
