"""What runs inside train.online_placement: ray's actors, and a trainer's side of the link (sources/ray_actors.py
places them): the capture actor, the trainer actor, the trainer's BatchSource over the capture actor, and a
micro-batch's form in Ray's object store.

The capture actor makes the micro-batches the process placement's serve_capture (sources/capture_link.py) makes
(online.capture_setup's producer, micro_batches from the first trainer's checkpoint position, the same order) and
hands micro-batch n to every trainer, its states only to the one that trains it (n % trainers, as TrainStep
shares a step's group). The queue is a number of object refs: a trainer keeps train.online_queue_batches calls of
`next_item` outstanding and adds one each time it takes a micro-batch; the actor runs its calls in turn, so the
capture runs that many ahead and then waits, as the process placement's credits. A trainer that stops waits for its
outstanding calls (what it had granted) and the driver then ends the actors.

Ray is not a dependency of the workbook: it is imported only in this placement's modules, when it runs.
"""

from __future__ import annotations

import os
import socket
from collections import deque
from pathlib import Path

import torch

from eagle3lib.train import TrainingError
from eagle3lib.train.runtime.batches import micro_batches, pack_val_rows
from eagle3lib.train.sources import online
from eagle3lib.train.sources.base import CAPTURE_SUMMARY

RAY_MISSING = (
    "train.online_placement: ray needs Ray in this environment (and on every host of the cluster): "
    "pip install 'ray>=2.52' (tested with 2.60.0), or set train.online_placement: process (one host)"
)


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise TrainingError(RAY_MISSING) from e
    return ray


# --------------------------------------------------------- the object store's form of a micro-batch ----


def to_store(mb: dict, with_states: bool) -> dict:
    """A micro-batch as Ray stores it: tensors as numpy arrays (kept without a copy in the object store, where
    torch tensors would be pickled), bfloat16 as its int16 bits (numpy has no bfloat16); without its states
    unless with_states."""
    out = {}
    for k, v in mb.items():
        if k in ("aux", "final", "aux_scale", "final_scale") and not with_states:
            continue
        if isinstance(v, torch.Tensor):
            v = v.detach().cpu().contiguous()
            v = ("bfloat16", v.view(torch.int16).numpy()) if v.dtype == torch.bfloat16 else ("", v.numpy())
        out[k] = v
    return out


def from_store(stored: dict) -> dict:
    """A micro-batch back from to_store: the store's arrays are read-only, so each tensor is copied once."""
    out = {}
    for k, v in stored.items():
        if isinstance(v, tuple):
            dtype, array = v
            v = torch.from_numpy(array.copy())
            v = v.view(torch.bfloat16) if dtype == "bfloat16" else v
        out[k] = v
    return out


# ------------------------------------------------------------------------------- the actors ----


def actor_overrides(p, overrides: dict | None) -> dict:
    """The params an actor loads: a Ray actor sees only the GPU it was given, as cuda:0."""
    overrides = dict(overrides or {})
    if p.target.device.startswith("cuda"):
        overrides["target.device"] = "cuda"
    return overrides


class CaptureActor:
    """The capture: loads the target on its device and serves the validation rows and the stream of micro-batches
    (made once, handed to every trainer, dropped when all took it)."""

    def __init__(self, params_file: str, run_dir: str, overrides: dict, trainers: int):
        from eagle3lib.params import load_params, stage_view

        self.p = stage_view(load_params(params_file, overrides), "02_train")
        self.run_dir, self.trainers = Path(run_dir), trainers
        self.train = self.val = None
        self.val_ref = self.stream = self.start = self.failed = None
        self.items, self.made, self.taken = {}, 0, [0] * trainers

    def ready(self) -> bool:
        return True

    def load(self) -> None:
        from eagle3lib.prepare import conversations

        prep = self.run_dir / "00_prepare"
        train_tokens = conversations.load_tokens(prep / "train.safetensors")
        val_tokens = conversations.load_tokens(prep / "val.safetensors")
        self.train, self.val, _ = online.capture_setup(self.p, train_tokens, val_tokens, self.run_dir / "02_train")

    def val_rows(self) -> list:
        """[ref] of the validation rows, put in the object store once for every trainer (a list: Ray hands an
        object ref inside a return value back as the ref)."""
        import ray

        if self.val_ref is None:
            rows = pack_val_rows(self.val.val_sequences(), self.p.train)
            self.val_ref = ray.put([to_store(row, True) for row in rows])
        return [self.val_ref]

    def next_item(self, trainer: int, start: tuple) -> tuple[int, int, dict]:
        """(epoch, index, micro-batch) of this trainer's next micro-batch in the stream from `start` (epoch, index,
        sequence: the checkpoint's position, the same on every trainer); its states only if it trains it."""
        if self.failed:
            raise TrainingError(f"the capture failed earlier: {self.failed}")
        if self.stream is None:
            epoch, index, sequence = start
            self.start = start
            # no thread: the outstanding calls bound how far ahead this actor captures
            self.stream = micro_batches(self.train.train_sequences, self.p.train, epoch, index, sequence, depth=0)
        elif tuple(start) != tuple(self.start):
            raise TrainingError(f"trainers resume from different positions: {tuple(start)} and {tuple(self.start)}")
        n = self.taken[trainer]
        while n >= self.made:
            try:
                self.items[self.made] = next(self.stream)
            except Exception as e:
                self.failed = f"{type(e).__name__}: {e}"
                raise
            self.made += 1
        epoch, index, mb = self.items[n]
        self.taken[trainer] += 1
        if min(self.taken) > n:
            del self.items[n]
        return epoch, index, to_store(mb, n % self.trainers == trainer)

    def close(self) -> None:
        """The target let go (an engine's tensor-parallel ranks stopped) before the driver ends this actor."""
        if self.train is not None:
            self.train.close()

    def summary(self) -> dict:
        """The capture's figures, written beside train_summary.json (the run folder every node sees)."""
        import json

        stats = online.online_stats(self.train)
        (self.run_dir / "02_train" / CAPTURE_SUMMARY).write_text(json.dumps(stats, indent=2) + "\n")
        return stats


class TrainerActor:
    """One trainer: runs the stage (launch.run_stage, handed in by the driver) with the capture actor."""

    def ready(self) -> bool:
        return True

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it, for torch.distributed's rendezvous."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def train(self, run_stage, params_file: str, run_dir: str, overrides: dict, capture, env: dict) -> dict:
        from eagle3lib.params import load_params, stage_view

        os.environ.update(env)
        return run_stage(stage_view(load_params(params_file, overrides), "02_train"), run_dir, handed=capture)


class RayCaptureClient:
    """A trainer's side, a BatchSource: the validation rows, then the stream of micro-batches from a loop state's
    position."""

    def __init__(self, capture, trainer: int, contract: dict):
        self.ray = import_ray()
        self.capture, self.trainer, self.contract = capture, trainer, contract

    def summary(self) -> dict:
        return {}  # the capture actor writes its own (CAPTURE_SUMMARY)

    def close(self) -> None:
        pass

    def _get(self, ref):
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayError as e:
            raise TrainingError(f"the capture actor failed: {getattr(e, 'cause', None) or e}") from e

    def val_rows(self, train_params=None) -> list[dict]:
        """The capture actor packed them (with the same train params)."""
        (ref,) = self._get(self.capture.val_rows.remote())
        return [from_store(row) for row in self._get(ref)]

    def stream(self, train_params, state: dict):
        """(epoch, index, micro-batch) from the state's position, train.online_queue_batches calls outstanding."""
        sequence = state.get("sequence_in_epoch")
        start = (state["epoch"], state["micro_in_epoch"], sequence)
        pending = deque(
            self.capture.next_item.remote(self.trainer, start) for _ in range(train_params.online_queue_batches)
        )
        try:
            while True:
                got = self._get(pending.popleft())
                pending.append(self.capture.next_item.remote(self.trainer, start))
                epoch, index, stored = got
                yield epoch, index, from_store(stored)
        finally:
            # the calls in flight complete (the capture makes what they asked for), so its summary is whole and
            # every trainer has taken the same micro-batches when the driver ends the actors
            for ref in pending:
                try:
                    self.ray.get(ref)
                except self.ray.exceptions.RayError:
                    break
