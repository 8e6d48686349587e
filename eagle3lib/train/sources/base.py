"""What the trainer sees of where its states come from, and how a placement starts the stage's processes.

    placement = sources.for_params(p)                         # the one choice (sources/__init__.py)
    placement.launch(StageRun(p, run_dir, run_stage))         # the stage's processes, started
    source = placement.open(StageProcess(p, run_dir, device, handed), tokens)   # in each trainer
    source.val_rows(train_params); source.stream(train_params, state); source.summary(); source.close()

A placement is one class in one file of this folder; a new one is a new file, its params, and a line in
`for_params`.
"""

from __future__ import annotations

import json
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from eagle3lib import run_folder
from eagle3lib.engines.server import run_guarded

TRAIN_ENTRY = "eagle3lib.train.runtime.launch"  # the stage's entry point in a process this layer starts (python -m)
SUMMARY = "train_summary.json"
CAPTURE_SUMMARY = "capture_summary.json"  # a capture process's or actor's figures, beside SUMMARY


class BatchSource(Protocol):
    """A trainer's micro-batches, as the loop takes them.

    contract            the states' contract (eagle3.json's fields: target fingerprint, hidden size, aux ids, ...)
    val_rows(tp)        the packed validation rows (train params tp), each a batch of one
    stream(tp, state)   (epoch, index in epoch, micro-batch) from the loop state's position on (a resume's: nothing
                        before it is read or captured); closing it stops what makes them
    summary()           what the source adds to train_summary.json ({} or {"online": the capture's figures})
    close()             what the source holds (a loaded target, an engine's ranks) is let go
    """

    contract: dict

    def val_rows(self, train_params) -> list[dict]: ...

    def stream(self, train_params, state: dict) -> Iterator[tuple[int, int, dict]]: ...

    def summary(self) -> dict: ...

    def close(self) -> None: ...


@dataclass
class StageRun:
    """02_train as its launcher starts it: the params (loaded once in this process), the run folder, and the stage's
    entry point `run_stage(p, run_dir, handed=None)` (handed in: this layer does not import train.launch)."""

    p: object
    run_dir: Path
    run_stage: Callable

    def command_args(self) -> list[str]:
        """The entry point's arguments in a process of its own: the params file, the run folder, the overrides."""
        return [self.p.file, str(self.run_dir), json.dumps(self.p.overrides)]

    def summary(self) -> dict:
        return json.loads((run_folder.stage_dir(self.run_dir, "02_train") / SUMMARY).read_text())


@dataclass
class StageProcess:
    """One process of the stage, as a placement opens its source there: the params, the run folder, the device this
    process trains on, and what its launcher handed it (a Ray capture actor; a capture already loaded)."""

    p: object
    run_dir: Path
    device: str
    handed: object = None


class Placement(ABC):
    """Where the capture and the trainers run. The default: every process trains, one process, or torchrun with
    train.nproc_per_node of them."""

    name = ""

    def launch(self, run: StageRun) -> dict:
        """Run the stage; returns the first trainer's summary."""
        nproc = run.p.train.nproc_per_node
        if nproc <= 1:
            return run.run_stage(run.p, run.run_dir)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        run_guarded([*cmd, "-m", TRAIN_ENTRY, *run.command_args()])  # no worker outlives the stage
        return run.summary()

    def check_started(self, proc: StageProcess) -> None:
        """A stage process this placement's launcher did not start is refused, saying what to do."""
        return None  # by default any process may train: run_stage called directly is the one-process stage

    def serves_capture(self, proc: StageProcess) -> bool:
        """In each process, before a trainer is built: whether this one only captured (it has, and is done)."""
        return False

    @abstractmethod
    def open(self, proc: StageProcess, tokens: dict) -> BatchSource:
        """This trainer's source of micro-batches; tokens: 00_prepare's {"train": ..., "val": ...} token splits."""


class OnlinePlacement(Placement):
    """train.source: online: the states are captured while the drafter trains, somewhere this placement says."""

    @abstractmethod
    def device_split(self, p) -> tuple[str, bool]:
        """(where the capture and the trainers run, in words; whether they share a device and so take turns), for
        00_prepare's online plan."""
