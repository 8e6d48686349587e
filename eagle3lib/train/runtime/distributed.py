"""Data parallel training: under torchrun each rank takes its share of every step's micro-batches and the
gradients are summed over ranks; one process is a world of one."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from eagle3lib.train import TrainingError
from eagle3lib.train.runtime.checkpoint import weights_digest

# Whether this process's default group is the trainers' (joined by init_process_group below: torchrun's, which
# spans the trainers only; online_placement: process links its capture process through groups of the link's own).
# With extract.backend sglang_inprocess in a thread, SGLang's model runner makes the default group of its
# tensor-parallel ranks instead: the one trainer then trains alone and leaves that group to SGLang.
_joined = False


def rank_and_world() -> tuple[int, int]:
    """(this process's rank among the trainers, number of trainers); (0, 1) outside torchrun."""
    if trainers_joined():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def trainers_joined() -> bool:
    """Whether this process trains in a process group of trainers it joined."""
    return _joined and dist.is_available() and dist.is_initialized()


def default_group() -> dict | None:
    """The default group this trainer joined, {backend, size} (size: the trainers, no capture process), or None."""
    if not trainers_joined():
        return None
    return {"backend": dist.get_backend(), "size": dist.get_world_size()}


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
    for work in [dist.all_reduce(p.grad, async_op=True) for p in params]:
        work.wait()


def check_same_weights(module: torch.nn.Module, world: int) -> list[str]:
    """Each rank's weights_digest of the module, after training: data parallel must leave every rank with the
    same weights, and a TrainingError says when it did not."""
    if world <= 1:
        return [weights_digest(module)]
    digests = [None] * world
    dist.all_gather_object(digests, weights_digest(module))
    if len(set(digests)) != 1:
        raise TrainingError(f"ranks hold different weights after training: {digests}")
    return digests


def rank0_value(value: int, world: int, device) -> int:
    """Rank 0's value on every rank (a decision each rank could make differently, from its own clock)."""
    if world <= 1:
        return value
    agreed = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(agreed, src=0)
    return int(agreed.item())


def any_rank(flag: bool, world: int, device) -> bool:
    """Whether flag holds on any rank, on every rank (so that all leave a loop on the same step)."""
    if world <= 1:
        return flag
    agreed = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return bool(agreed.item())
