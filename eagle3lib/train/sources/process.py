"""train.online_placement: process. One capture process (rank 0) runs the target and sends micro-batches to the
trainer ranks (1..N) through torch.distributed: gloo on the CPU, NCCL on GPUs, the same code (the backend is
the default group's, picked by the device in distributed.init_process_group). Headers and credits always go
over a gloo group (small CPU tensors); the batches' tensors over the default group, on the trainer's device.

The wire, per micro-batch n and trainer r (tensors of fixed shapes, known to both sides from the params):
    header  int64 [8]: kind, epoch, index, next_sequence, tokens, has_states, rows, 0
    ids     int64 [4, rows, max_seq_len]: input_ids, loss_mask, doc_ids, position_ids
    aux     [rows, max_seq_len, k*H], final [rows, max_seq_len, H] in the target's dtype: only to the trainer
            that trains micro-batch n (n % N, as TrainStep shares a step's group); the others count its
            valid positions from ids alone, as the step's normalizer needs
The queue is bounded by credits: a trainer grants train.online_queue_batches at its start and one more each time
it takes a micro-batch; the capture sends only against credit, so it runs that many ahead and waits after. A
trainer that stops sends STOP and takes what it had granted; the capture, on reading it, ends.

Beyond one host: train.online_placement: ray (sources/ray_actors.py) puts the same producer in a Ray actor and
the states in Ray's object store.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from eagle3lib.train import TrainingError, online
from eagle3lib.train.batches import micro_batches, pack_val_rows
from eagle3lib.train.distributed import split_capture_rank
from eagle3lib.train.sources.base import CAPTURE_SUMMARY, OnlinePlacement, StageProcess

BATCH, VAL, VAL_END, ERROR = 1, 2, 3, 4
STOP = -1
HEADER = 8
ID_KEYS = ("input_ids", "loss_mask", "doc_ids", "position_ids")
MAX_ERROR_BYTES = 8192

_control = None  # the gloo group of headers and credits (made once per process, by every rank, in order)


def control_group():
    global _control
    if _control is None:
        _control = dist.new_group(backend="gloo")
    return _control


def _header(kind, epoch=0, index=0, next_sequence=0, tokens=0, has_states=0, rows=0) -> torch.Tensor:
    return torch.tensor([kind, epoch, index, next_sequence, tokens, has_states, rows, 0], dtype=torch.long)


class _Sender:
    """The capture side's sends: every request in flight is kept until it completes (the tensors with it)."""

    def __init__(self, device):
        self.device, self.pending = device, []

    def send(self, rank: int, header: torch.Tensor, tensors: list[torch.Tensor]):
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]
        self.pending.append((dist.isend(header, rank, group=control_group()), header))
        for t in tensors:
            t = t.to(self.device)
            self.pending.append((dist.isend(t, rank), t))

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
            dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), r, group=control_group())

    def drain(self):
        for w, _ in self.pending:
            w.wait()
        self.pending = []


def serve_capture(p, run_dir: Path, device) -> dict:
    """Rank 0: load the target, send the validation rows, then micro-batches from the position the first trainer
    sends (its checkpoint's), against the trainers' credits, until they stop. Returns the capture's stats."""
    from eagle3lib.prepare import conversations

    trainers = list(range(1, dist.get_world_size()))
    sender = _Sender(device)
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
        start = torch.zeros(3, dtype=torch.long)
        dist.recv(start, 1, group=control_group())
        epoch, index, sequence = start.tolist()
        start_sequence = None if sequence < 0 else sequence
        # no thread: this process only captures, and the trainers' credits bound how far ahead
        stream = micro_batches(train_data.train_sequences, p.train, epoch, index, start_sequence, depth=0)
        credits = dict.fromkeys(trainers, 0)
        for n, (epoch, index, mb) in enumerate(stream):
            for r in trainers:
                if credits[r] == 0:
                    credits[r] = _credit(r)
            if any(c == STOP for c in credits.values()):
                for r in trainers:  # every trainer stops after the same step, with as many credits granted
                    if credits[r] != STOP and _credit(r) != STOP:
                        raise TrainingError(f"trainer rank {r} granted credit after another one stopped")
                break
            for r in trainers:
                sender.item(r, BATCH, epoch, index, mb, r == trainers[n % len(trainers)])
                credits[r] -= 1
        sender.drain()
    except Exception as e:
        sender.error(trainers, f"{type(e).__name__}: {e}")
        raise
    stats = online.online_stats(train_data)
    (run_dir / "02_train" / CAPTURE_SUMMARY).write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def _credit(rank: int) -> int:
    got = torch.zeros(1, dtype=torch.long)
    dist.recv(got, rank, group=control_group())
    return int(got)


class CaptureClient:
    """A trainer's side, a BatchSource: the validation rows, then the stream of micro-batches from a loop state's
    position."""

    def __init__(self, p, contract: dict, device):
        from eagle3lib import target

        self.contract = contract
        self.device, self.length = device, p.train.max_seq_len
        self.hidden, self.aux = contract["hidden_size"], contract["hidden_size"] * len(contract["aux_layer_ids"])
        self.dtype = target.torch_dtype(p.target.dtype)
        self.credits_in_flight = []
        self.granted = self.received = 0
        self.broken = False

    def _receive(self) -> tuple[int, int, int, dict | None]:
        """(kind, epoch, index, micro-batch) of the next item the capture process sends."""
        header = torch.zeros(HEADER, dtype=torch.long)
        dist.recv(header, 0, group=control_group())
        kind, epoch, index, next_sequence, tokens, has_states, rows, _ = header.tolist()
        if kind == ERROR:
            message = torch.zeros(tokens, dtype=torch.uint8)
            dist.recv(message, 0, group=control_group())
            self.broken = True  # nothing more comes: a stop would wait for batches that are never sent
            raise TrainingError(f"the capture process (rank 0) failed: {bytes(message.tolist()).decode()}")
        if kind == VAL_END:
            return kind, 0, 0, None
        ids = torch.empty(len(ID_KEYS), rows, self.length, dtype=torch.long, device=self.device)
        dist.recv(ids, 0)
        mb = dict(zip(ID_KEYS, ids, strict=True)) | {"tokens": tokens, "next_sequence": next_sequence}
        if has_states:
            mb["aux"] = torch.empty(rows, self.length, self.aux, dtype=self.dtype, device=self.device)
            mb["final"] = torch.empty(rows, self.length, self.hidden, dtype=self.dtype, device=self.device)
            dist.recv(mb["aux"], 0)
            dist.recv(mb["final"], 0)
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
        self.credits_in_flight.append((dist.isend(t, 0, group=control_group()), t))
        if n > 0:
            self.granted += n

    def stream(self, train_params, state: dict):
        """(epoch, index, micro-batch) from the state's position; the capture runs train.online_queue_batches
        ahead. Closing it stops the capture process."""
        rank = dist.get_rank()
        if rank == 1:  # the first trainer says where the run stands (its checkpoint's position)
            sequence = state.get("sequence_in_epoch")
            start = [state["epoch"], state["micro_in_epoch"], -1 if sequence is None else sequence]
            dist.send(torch.tensor(start, dtype=torch.long), 0, group=control_group())
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
        """Tell the capture process to end and take what it sent against credit already granted."""
        self._grant(STOP)
        for _ in range(self.granted - self.received):
            self._receive()
            self.received += 1
        for w, _ in self.credits_in_flight:
            w.wait()

    def summary(self) -> dict:
        return {}  # the capture process writes its own (CAPTURE_SUMMARY)

    def close(self) -> None:
        pass


class CaptureProcess(OnlinePlacement):
    """Rank 0 of a torchrun world captures, ranks 1..N train (train.nproc_per_node of them)."""

    name = "process"
    capture_ranks = 1

    def check_started(self, proc: StageProcess) -> None:
        if not dist.is_initialized():
            raise TrainingError(
                "train.online_placement: process runs a capture process beside the trainers: start the stage with "
                "launch.launch (the 02_train notebook does), or set train.online_placement: thread"
            )

    def serves_capture(self, proc: StageProcess) -> bool:
        is_capture = split_capture_rank()
        control_group()  # every rank makes it, in the same order
        if is_capture:
            serve_capture(proc.p, Path(proc.run_dir), proc.device)
            dist.barrier()
            dist.destroy_process_group()
        return is_capture

    def open(self, proc: StageProcess, tokens: dict) -> CaptureClient:
        return CaptureClient(proc.p, online.contract_without_weights(proc.p), proc.device)

    def device_split(self, p) -> tuple[str, bool]:
        trainers = p.train.nproc_per_node
        if p.target.device.startswith("cuda"):
            return f"the capture process on cuda:0, {trainers} trainer(s) on cuda:1..{trainers} (NCCL)", False
        return f"the capture process and {trainers} trainer(s) share this CPU's cores (gloo)", True
