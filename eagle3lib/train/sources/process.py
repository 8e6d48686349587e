"""train.online_placement: process. One capture process runs the target and sends micro-batches to the trainers
(train.nproc_per_node of them: one process, or torchrun's workers) over a link of its own (sources/capture_link.py):
process groups made from a store the launcher holds, not the default group. The trainers' default group spans
the trainers alone (gradients are summed there, data parallel as ever); the capture process's is left free, so
that SGLang's model runner can make its tensor-parallel world there (extract.backend sglang_inprocess: the capture
process runs in SGLang's interpreter, the trainers in this one). Headers and credits go over the link's gloo
group (small CPU tensors); the batches' tensors over its data group: NCCL between GPUs, gloo on the CPU.

The wire, per micro-batch n and trainer r (link rank r: the capture is 0, trainer t is t + 1; tensors of fixed
shapes, known to both sides from the params):
    header  int64 [8]: kind, epoch, index, next_sequence, tokens, has_states, rows, 0
    ids     int64 [4, rows, max_seq_len]: input_ids, loss_mask, doc_ids, position_ids
    aux     [rows, max_seq_len, k*H], final [rows, max_seq_len, H] in the target's dtype: only to the trainer
            that trains micro-batch n (n % N, as TrainStep shares a step's group); the others count its
            valid positions from ids alone, as the step's normalizer needs
The queue is bounded by credits: a trainer grants train.online_queue_batches at its start and one more each time
it takes a micro-batch; the capture sends only against credit, so it runs that many ahead and waits after. A
trainer that stops sends STOP and takes what it had granted; the capture, on reading it, ends, and both sides meet
at the link's barrier. Trainers that read no stream (no step left: a finished run started again) send the start
position NOTHING, and the capture captures nothing. A failed capture sends ERROR with its message, which the
trainers raise.

Beyond one host: train.online_placement: ray (sources/ray_actors.py) puts the same producer in a Ray actor and
the states in Ray's object store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import deque
from pathlib import Path

import torch

from eagle3lib import run_folder
from eagle3lib.engines.server import run_guarded_together
from eagle3lib.train import TrainingError, online
from eagle3lib.train.batches import micro_batches, pack_val_rows
from eagle3lib.train.distributed import rank_and_world
from eagle3lib.train.sources.base import CAPTURE_SUMMARY, TRAIN_ENTRY, OnlinePlacement, StageProcess, StageRun
from eagle3lib.train.sources.capture_link import CAPTURE, LINK_ENV, ROLE_ENV, Link, is_capture, link_env, open_store

BATCH, VAL, VAL_END, ERROR = 1, 2, 3, 4
STOP = -1
NOTHING = -1  # the start position's epoch when the trainers read no stream
HEADER = 8
ID_KEYS = ("input_ids", "loss_mask", "doc_ids", "position_ids")
MAX_ERROR_BYTES = 8192
CAPTURE_LOG = "capture.log"  # under 02_train: the capture process's output
LOG_TAIL_LINES = 40  # of the capture's log, in the stage's error when it failed
# torchrun's variables: the launcher's own (a launcher started under torchrun) must not reach its processes
TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


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
        ahead. Closing it stops the capture process."""
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


def log_tail(log: Path) -> str:
    if not log.is_file():
        return ""
    with open(log, errors="replace") as f:
        return "".join(deque(f, maxlen=LOG_TAIL_LINES))


class CaptureProcess(OnlinePlacement):
    """A capture process beside train.nproc_per_node trainers (one process, or torchrun's workers), linked by
    process groups of their own."""

    name = "process"

    def launch(self, run: StageRun) -> dict:
        """The capture process and the trainers, started together under guards (none outlives the stage; when one
        fails the other is ended); the link's store is held here. Returns the first trainer's summary."""
        p, n = run.p, run.p.train.nproc_per_node
        store = open_store()
        common = link_env(store, n) | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}  # as torchrun's
        capture_gpus, trainer_gpus = self.split_gpus(p)
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

    def split_gpus(self, p) -> tuple[dict, dict]:
        """(CUDA_VISIBLE_DEVICES of the capture process, of the trainers), {} each on the CPU."""
        if not p.target.device.startswith("cuda"):
            return {}, {}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        k, n = self.capture_gpus(p), p.train.nproc_per_node
        if len(gpus) < k + n:
            raise TrainingError(
                f"train.online_placement: {self.name} gives the capture {k} GPU(s) and each of the {n} trainer(s) "
                f"one of its own: {k + n} GPUs, and {len(gpus)} are visible; lower train.nproc_per_node, or set "
                "train.online_placement: thread (the capture and the trainer then share a GPU)"
            )
        return {"CUDA_VISIBLE_DEVICES": ",".join(gpus[:k])}, {"CUDA_VISIBLE_DEVICES": ",".join(gpus[k : k + n])}

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
        if p.target.device.startswith("cuda"):
            return f"the capture process on cuda:0, {trainers} trainer(s) on cuda:1..{trainers} (NCCL)", False
        return f"the capture process and {trainers} trainer(s) share this CPU's cores (gloo)", True


def _without_torchrun(env: dict) -> dict:
    return {k: v for k, v in env.items() if k not in TORCHRUN_VARS}


class InEngineProcess(CaptureProcess):
    """The process placement with SGLang's model runner as the capture (extract.backend sglang_inprocess): the
    capture process runs in SGLang's interpreter (engine.python, else .venv-sglang), its tensor-parallel ranks on
    the first GPUs (its default group is theirs); the trainers run in this interpreter, on the GPUs after them."""

    name = "process (sglang_inprocess)"

    def capture_command(self, run: StageRun, env: dict) -> tuple[list[str], dict]:
        from eagle3lib.engines.interpreter import module_env
        from eagle3lib.extract.backends import engine_settings

        engine = engine_settings(run.p, "sglang")
        if engine["python"] is None:
            raise FileNotFoundError(
                "train.source: online with extract.backend sglang_inprocess captures in SGLang's interpreter and none "
                "was found: set engine.name: sglang and engine.python, or build .venv-sglang (make sglang-env)"
            )
        command = [engine["python"], "-m", TRAIN_ENTRY, *run.command_args()]
        return command, _without_torchrun(module_env({**engine["env"], **env}))

    def capture_gpus(self, p) -> int:
        from eagle3lib.engines.sglang import tp_size
        from eagle3lib.extract.backends import engine_settings

        return tp_size(engine_settings(p, "sglang")["extra_args"])

    def device_split(self, p) -> tuple[str, bool]:
        k, n = self.capture_gpus(p), p.train.nproc_per_node
        return (
            f"SGLang's model runner in a capture process (SGLang's interpreter) on cuda:0..{k - 1}, {n} trainer(s) "
            f"on cuda:{k}..{k + n - 1} (NCCL, or gloo through host memory when the two torch builds' NCCL differ)",
            False,
        )
