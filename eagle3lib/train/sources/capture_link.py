"""The link between online_placement: process's capture process and its trainers: process groups made for the link
only, from a TCPStore the stage's launcher holds, so that no process's default torch.distributed group is involved.
The trainers' default group (torchrun's) spans the trainers alone; the capture process's is left free, for SGLang's
tensor-parallel ranks to own (docs/design.md §8, online mode).

    store = open_store()                                    # the launcher: a store at a port of its own
    env = link_env(store, nproc)                            # what its processes find the link by
    link = Link.join(rank, device)                          # in each: rank 0 the capture, 1..N the trainers
    link.isend(t, dst, control=True); link.recv(t, src); link.barrier(); link.close()

Two groups over the same store: `control` (gloo, small CPU tensors: headers and credits) and `data` (the batches'
tensors): NCCL on GPUs when both sides' torch carries the same NCCL (the capture may run in an engine's interpreter,
another torch build), gloo through host memory otherwise and on the CPU. Each side writes its versions to the store
before either group is made, so both pick the same.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

LINK_ENV = "EAGLE3_CAPTURE_LINK"  # host:port of the link's store, and the link's size: "HOST:PORT:SIZE"
ROLE_ENV = "EAGLE3_CAPTURE_ROLE"  # "capture" in the capture process (rank 0 of the link); unset in the trainers
CAPTURE = "capture"
HOST = "127.0.0.1"  # one host: the capture process and the trainers are the launcher's children
# A dead peer is seen at once (its connection closes; the launcher ends the other side), so the bound is for a
# capture that is slow to load, not for a failure: a large target takes long before its first batch.
TIMEOUT = timedelta(hours=3)


def open_store() -> dist.TCPStore:
    """The launcher's store (the link's rendezvous), at a port the system picks; kept open while the stage runs."""
    return dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


def link_env(store: dist.TCPStore, trainers: int) -> dict:
    """The environment a process of the stage finds the link by (the capture adds ROLE_ENV)."""
    return {LINK_ENV: f"{HOST}:{store.port}:{trainers + 1}"}


def is_capture() -> bool:
    """Whether this process is the stage's capture process (its launcher said so)."""
    return os.environ.get(ROLE_ENV) == CAPTURE


def versions() -> dict:
    """What the data group's backend depends on: this torch and the NCCL it carries (None without CUDA)."""
    nccl = None
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {"torch": torch.__version__, "nccl": nccl}


def data_backend(device: str, capture: dict, trainer: dict) -> str:
    """nccl when the states are on GPUs and both sides carry the same NCCL (one communicator needs one version),
    else gloo (on a GPU host the states then go through host memory)."""
    if str(device).startswith("cuda") and capture["nccl"] and capture["nccl"] == trainer["nccl"]:
        return "nccl"
    return "gloo"


class Link:
    """One process's end of the link: rank 0 the capture process, ranks 1..N the trainers."""

    def __init__(self, store, rank: int, size: int, device: str):
        self.rank, self.size = rank, size
        store.set(f"versions/{rank}", json.dumps(versions()))
        capture, trainer = (json.loads(store.get(f"versions/{r}")) for r in (0, 1))
        self.backend = data_backend(device, capture, trainer)
        self.data_device = torch.device("cpu")
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control/", store), rank, size, TIMEOUT)
        if self.backend == "nccl":
            index = torch.device(device).index
            self.data_device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
            torch.cuda.set_device(self.data_device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = TIMEOUT
            self.data = dist.ProcessGroupNCCL(dist.PrefixStore("data/", store), rank, size, options)
        else:
            self.data = dist.ProcessGroupGloo(dist.PrefixStore("data/", store), rank, size, TIMEOUT)
        self.store = store

    @classmethod
    def join(cls, rank: int, device: str) -> Link:
        """This process's end, at the store its launcher named in LINK_ENV."""
        where = os.environ.get(LINK_ENV)
        if not where:
            raise RuntimeError(f"{LINK_ENV} is not set: this process was not started by the process placement")
        host, port, size = where.rsplit(":", 2)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=TIMEOUT)
        return cls(store, rank, int(size), device)

    def group(self, control: bool):
        return self.control if control else self.data

    def isend(self, tensor: torch.Tensor, dst: int, control: bool = False):
        """Start sending; returns the request (wait() on it, keep the tensor until then)."""
        return self.group(control).send([tensor], dst, 0)

    def send(self, tensor: torch.Tensor, dst: int, control: bool = False) -> None:
        self.isend(tensor, dst, control).wait()

    def recv(self, tensor: torch.Tensor, src: int, control: bool = False) -> torch.Tensor:
        self.group(control).recv([tensor], src, 0).wait()
        return tensor

    def barrier(self) -> None:
        """Every end of the link is here: what was sent was taken."""
        self.control.barrier().wait()

    def close(self) -> None:
        for group in (self.data, self.control):
            getattr(group, "shutdown", lambda: None)()
