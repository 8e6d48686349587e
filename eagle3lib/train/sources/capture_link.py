"""The link between online_placement: process's capture process and its trainers: process groups made for the link
only, from a TCPStore the stage's launcher holds, so that no process's default torch.distributed group is involved.
The trainers' default group (torchrun's) spans the trainers alone; the capture process's is left free, for SGLang's
tensor-parallel ranks to own (docs/design.md §8, online mode).

    store = open_store()                                    # the launcher: a store at a port of its own
    env = link_env(store, nproc)                            # what its processes find the link by
    link = Link.join(rank, device)                          # in each: rank 0 the capture, 1..N the trainers
    link.isend(t, dst, control=True); link.recv(t, src); link.barrier(); link.close()

Two groups over the same store: `control` (gloo, small CPU tensors: headers and credits) and `data` (the batches'
tensors): NCCL on GPUs of their own when both sides' torch carries the same NCCL (the capture may run in an engine's
interpreter, another torch build), gloo through host memory otherwise (the capture and a trainer on one GPU among
them) and on the CPU. Each side writes its versions to the store
before either group is made, so both pick the same.

What goes over it, per micro-batch n and trainer r (link rank r: the capture is 0, trainer t is t + 1; tensors of
fixed shapes, known to both sides from the params):
    header  int64 [8]: kind, epoch, index, next_sequence, tokens, has_states, rows, 0   (control)
    ids     int64 [4, rows, max_seq_len]: input_ids, loss_mask, doc_ids, position_ids    (data)
    aux     [rows, max_seq_len, k*H], final [rows, max_seq_len, H] in the target's dtype (data): only to the
            trainer that trains micro-batch n (n % N, as TrainStep shares a step's group); the others count its
            valid positions from ids alone, as the step's normalizer needs
The capture process (serve_capture) first sends the validation rows, then reads the start position the first
trainer sends (its checkpoint's) and sends micro-batches from there. The queue is bounded by credits: a trainer
(CaptureClient) grants train.online_queue_batches at its start and one more each time it takes a micro-batch; the
capture sends only against credit, so it runs that many ahead and waits after. A trainer that stops sends STOP and
takes what it had granted; the capture, on reading it, ends, and both sides meet at the link's barrier. Trainers
that read no stream (no step left: a finished run started again) send the start position NOTHING, and the capture
captures nothing. A failed capture sends ERROR with its message, which the trainers raise.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from eagle3lib.train import TrainingError
from eagle3lib.train.runtime.batches import in_background, micro_batches, pack_val_rows
from eagle3lib.train.sources import online
from eagle3lib.train.sources.base import CAPTURE_SUMMARY

LINK_ENV = "EAGLE3_CAPTURE_LINK"  # host:port of the link's store, and the link's size: "HOST:PORT:SIZE"
THROUGH_HOST_ENV = "EAGLE3_CAPTURE_LINK_THROUGH_HOST"  # "1": the data group is gloo (the sides share a GPU)
ROLE_ENV = "EAGLE3_CAPTURE_ROLE"  # "capture" in the capture process (rank 0 of the link); unset in the trainers
CAPTURE = "capture"
HOST = "127.0.0.1"  # one host: the capture process and the trainers are the launcher's children
# A dead peer is seen at once (its connection closes; the launcher ends the other side), so the bound is for a
# capture that is slow to load, not for a failure: a large target takes long before its first batch.
TIMEOUT = timedelta(hours=3)

BATCH, VAL, VAL_END, ERROR = 1, 2, 3, 4  # a header's kind
STOP = -1  # a credit that ends the capture
NOTHING = -1  # the start position's epoch when the trainers read no stream
HEADER = 8
ID_KEYS = ("input_ids", "loss_mask", "doc_ids", "position_ids")
MAX_ERROR_BYTES = 8192


def open_store() -> dist.TCPStore:
    """The launcher's store (the link's rendezvous), at a port the system picks; kept open while the stage runs."""
    return dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


def link_env(store: dist.TCPStore, trainers: int, through_host: bool = False) -> dict:
    """The environment a process of the stage finds the link by (the capture adds ROLE_ENV); through_host: the
    states go through host memory whatever NCCL says (the capture and a trainer on one GPU, where NCCL cannot
    make a communicator)."""
    return {LINK_ENV: f"{HOST}:{store.port}:{trainers + 1}", THROUGH_HOST_ENV: "1" if through_host else "0"}


def is_capture() -> bool:
    """Whether this process is the stage's capture process (its launcher said so)."""
    return os.environ.get(ROLE_ENV) == CAPTURE


def versions() -> dict:
    """What the data group's backend depends on: this torch and the NCCL it carries (None without CUDA)."""
    nccl = None
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {"torch": torch.__version__, "nccl": nccl}


def data_backend(device: str, capture: dict, trainer: dict, through_host: bool = False) -> str:
    """nccl when the states are on GPUs of their own and both sides carry the same NCCL (one communicator needs one
    version), else gloo (on a GPU host the states then go through host memory)."""
    if through_host or not str(device).startswith("cuda"):
        return "gloo"
    return "nccl" if capture["nccl"] and capture["nccl"] == trainer["nccl"] else "gloo"


class Link:
    """One process's end of the link: rank 0 the capture process, ranks 1..N the trainers."""

    def __init__(self, store, rank: int, size: int, device: str):
        self.rank, self.size = rank, size
        store.set(f"versions/{rank}", json.dumps(versions()))
        capture, trainer = (json.loads(store.get(f"versions/{r}")) for r in (0, 1))
        self.backend = data_backend(device, capture, trainer, os.environ.get(THROUGH_HOST_ENV) == "1")
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


# ----------------------------------------------------------------------------------- the wire ----


def _header(kind, epoch=0, index=0, next_sequence=0, tokens=0, has_states=0, rows=0) -> torch.Tensor:
    return torch.tensor([kind, epoch, index, next_sequence, tokens, has_states, rows, 0], dtype=torch.long)


class _Sender:
    """The capture side's sends: every request in flight is kept until it completes (the tensors with it)."""

    def __init__(self, link: Link):
        self.link, self.pending = link, []

    def send(self, rank: int, header: torch.Tensor, tensors: list[torch.Tensor]):
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]
        self.pending.append((self.link.isend(header, rank, control=True), header))
        for t in tensors:
            t = t.to(self.link.data_device)
            self.pending.append((self.link.isend(t, rank), t))

    def item(self, rank: int, kind: int, epoch: int, index: int, mb: dict, with_states: bool):
        rows = mb["input_ids"].shape[0]
        header = _header(kind, epoch, index, mb.get("next_sequence", 0), mb["tokens"], int(with_states), rows)
        tensors = [torch.stack([mb[k].long() for k in ID_KEYS])]
        if with_states:
            tensors += [mb["aux"].contiguous(), mb["final"].contiguous()]
        self.send(rank, header, tensors)

    def error(self, ranks, message: str):
        data = message.encode()[:MAX_ERROR_BYTES]
        for r in ranks:
            self.send(r, _header(ERROR, tokens=len(data)), [])
            self.link.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), r, control=True)

    def drain(self):
        for w, _ in self.pending:
            w.wait()
        self.pending = []


def serve_capture(p, run_dir: Path, link: Link) -> dict:
    """The capture process: load the target, send the validation rows, then micro-batches from the position the
    first trainer sends (its checkpoint's), against the trainers' credits, until they stop. Returns the capture's
    stats."""
    from eagle3lib.prepare import conversations

    trainers = list(range(1, link.size))
    sender, train_data = _Sender(link), None
    try:
        prep = run_dir / "00_prepare"
        train_tokens = conversations.load_tokens(prep / "train.safetensors")
        val_tokens = conversations.load_tokens(prep / "val.safetensors")
        train_data, val_data, _ = online.capture_setup(p, train_tokens, val_tokens, run_dir / "02_train")
        for row in pack_val_rows(val_data.val_sequences(), p.train):
            for r in trainers:
                sender.item(r, VAL, 0, 0, row, True)
        for r in trainers:
            sender.send(r, _header(VAL_END), [])
        epoch, index, sequence = link.recv(torch.zeros(3, dtype=torch.long), 1, control=True).tolist()
        start_sequence = None if sequence < 0 else sequence
        # no thread: this process only captures, and the trainers' credits bound how far ahead; epoch NOTHING: the
        # trainers have no step left to take (a finished run started again) and read no stream
        stream = (
            ()
            if epoch == NOTHING
            else micro_batches(train_data.train_sequences, p.train, epoch, index, start_sequence, depth=0)
        )
        credits = dict.fromkeys(trainers, 0)
        for n, (epoch, index, mb) in enumerate(stream):
            for r in trainers:
                if credits[r] == 0:
                    credits[r] = _credit(link, r)
            if any(c == STOP for c in credits.values()):
                for r in trainers:  # every trainer stops after the same step, with as many credits granted
                    if credits[r] != STOP and _credit(link, r) != STOP:
                        raise TrainingError(f"trainer {r - 1} granted credit after another one stopped")
                break
            for r in trainers:
                sender.item(r, BATCH, epoch, index, mb, r == trainers[n % len(trainers)])
                credits[r] -= 1
        sender.drain()
        stats = online.online_stats(train_data)
    except Exception as e:
        sender.error(trainers, f"{type(e).__name__}: {e}")
        raise
    finally:
        if train_data is not None:
            train_data.close()  # an engine's tensor-parallel ranks stop
    # the default group: None for the hf capture; SGLang's tensor-parallel world when its model runner made one
    stats["default_group"] = _default_group_size()
    (run_dir / "02_train" / CAPTURE_SUMMARY).write_text(json.dumps(stats, indent=2) + "\n")
    link.barrier()  # the trainers took what they had granted
    return stats


def _default_group_size() -> int | None:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else None


def _credit(link: Link, rank: int) -> int:
    return int(link.recv(torch.zeros(1, dtype=torch.long), rank, control=True))


class CaptureClient:
    """A trainer's side, a BatchSource: the validation rows, then the stream of micro-batches from a loop state's
    position. first: this is the first trainer, which says where the run stands."""

    def __init__(self, p, contract: dict, device, link: Link, first: bool):
        from eagle3lib import target

        self.contract, self.link, self.first = contract, link, first
        self.device, self.length = device, p.train.max_seq_len
        self.hidden, self.aux = contract["hidden_size"], contract["hidden_size"] * len(contract["aux_layer_ids"])
        self.dtype = target.torch_dtype(p.target.dtype)
        self.credits_in_flight = []
        self.granted = self.received = 0
        self.broken = self.started = False

    def _tensor(self, *shape, dtype) -> torch.Tensor:
        """One tensor of the wire, received on the link's data device."""
        return self.link.recv(torch.empty(*shape, dtype=dtype, device=self.link.data_device), 0)

    def _receive(self) -> tuple[int, int, int, dict | None]:
        """(kind, epoch, index, micro-batch) of the next item the capture process sends."""
        header = self.link.recv(torch.zeros(HEADER, dtype=torch.long), 0, control=True)
        kind, epoch, index, next_sequence, tokens, has_states, rows, _ = header.tolist()
        if kind == ERROR:
            message = self.link.recv(torch.zeros(tokens, dtype=torch.uint8), 0, control=True)
            self.broken = True  # nothing more comes: a stop would wait for batches that are never sent
            raise TrainingError(f"the capture process failed: {bytes(message.tolist()).decode()}")
        if kind == VAL_END:
            return kind, 0, 0, None
        ids = self._tensor(len(ID_KEYS), rows, self.length, dtype=torch.long).to(self.device)
        mb = dict(zip(ID_KEYS, ids, strict=True)) | {"tokens": tokens, "next_sequence": next_sequence}
        if has_states:
            mb["aux"] = self._tensor(rows, self.length, self.aux, dtype=self.dtype).to(self.device)
            mb["final"] = self._tensor(rows, self.length, self.hidden, dtype=self.dtype).to(self.device)
        return kind, epoch, index, mb

    def val_rows(self, train_params=None) -> list[dict]:
        """The capture process packed them (with the same train params)."""
        rows = []
        while True:
            kind, _, _, mb = self._receive()
            if kind == VAL_END:
                return rows
            rows.append(mb)

    def _grant(self, n: int):
        self.credits_in_flight = [(w, t) for w, t in self.credits_in_flight if not w.is_completed()]
        t = torch.tensor([n], dtype=torch.long)
        self.credits_in_flight.append((self.link.isend(t, 0, control=True), t))
        if n > 0:
            self.granted += n

    def stream(self, train_params, state: dict):
        """(epoch, index, micro-batch) from the state's position; the capture runs train.online_queue_batches
        ahead, and a thread of this process receives train.batch_prefetch of them ahead of the step (the wire and
        the copy to the device overlap the step, as the thread placement's queue hands over states already there).
        Closing it stops the capture process."""
        return in_background(self._received(train_params, state), train_params.batch_prefetch)

    def _received(self, train_params, state: dict):
        if self.link.data_device.type == "cuda":  # the current GPU is a thread's own: this thread's is the link's
            torch.cuda.set_device(self.link.data_device)
        self.started = True
        if self.first:  # the first trainer says where the run stands (its checkpoint's position)
            sequence = state.get("sequence_in_epoch")
            start = [state["epoch"], state["micro_in_epoch"], -1 if sequence is None else sequence]
            self.link.send(torch.tensor(start, dtype=torch.long), 0, control=True)
        self._grant(train_params.online_queue_batches)
        try:
            while True:
                _, epoch, index, mb = self._receive()
                self.received += 1
                self._grant(1)
                yield epoch, index, mb
        finally:
            if not self.broken:
                self._stop()

    def _stop(self):
        """Tell the capture process to end, take what it sent against credit already granted, and meet it at the
        link's barrier."""
        self._grant(STOP)
        for _ in range(self.granted - self.received):
            self._receive()
            self.received += 1
        for w, _ in self.credits_in_flight:
            w.wait()
        self.link.barrier()

    def summary(self) -> dict:
        return {}  # the capture process writes its own (CAPTURE_SUMMARY)

    def close(self) -> None:
        """The link let go; when the stream was never read (the run had no step left), the capture process is told
        there is nothing to capture first, and both meet at the link's barrier."""
        if not self.started and not self.broken:
            if self.first:
                self.link.send(torch.tensor([NOTHING, 0, -1], dtype=torch.long), 0, control=True)
            self.link.barrier()
        self.link.close()
