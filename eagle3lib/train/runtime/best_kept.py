"""train.keep_best_at: the best evaluated drafter of a run, kept on disk beside the checkpoints and written as the
stage's drafter instead of the last state."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from eagle3lib.drafter import Drafter
from eagle3lib.train.runtime.checkpoint import load_drafter, save_drafter

BEST = "best"  # the best evaluated state so far, under train.keep_best_at (a drafter folder with best.json)


class BestKept:
    """train.keep_best_at: the evaluated state with the highest est. AL at that depth, the starting one included,
    kept on disk (rank 0 writes BEST after each new best; a resume reads it back; a fresh run, or other budgets,
    from which the schedule's length follows, drop it) and written as the stage's drafter instead of the last
    state. Off (depth None): the last."""

    def __init__(self, folder: Path, depth: int | None, schedule: dict, step: int, rank: int, log):
        self.folder, self.depth, self.schedule, self.rank, self.log = folder, depth, schedule, rank, log
        self.step, self.eval = None, None
        record = folder / "best.json"
        if depth is not None and step > 0 and record.is_file():
            saved = json.loads(record.read_text())
            if (saved["depth"], saved.get("schedule")) == (depth, schedule):
                self.step, self.eval = saved["step"], saved["eval"]
            else:
                log(f"{folder} was kept for another depth or other budgets: the best is looked for again from here")
        elif rank == 0 and folder.exists():  # a fresh run does not mix with an earlier run's best
            shutil.rmtree(folder)

    def value(self, result: dict) -> float:
        return result["est_accept_len"][str(self.depth)]

    def consider(self, result: dict, drafter: Drafter, contract: dict) -> None:
        if self.depth is None or (self.eval is not None and self.value(result) <= self.value(self.eval)):
            return
        self.step, self.eval = result["at_step"], result
        if self.rank == 0:
            record = {"depth": self.depth, "step": self.step, "schedule": self.schedule, "eval": result}
            save_drafter(drafter, self.folder, contract, extra={"best.json": record})

    def is_last(self, last_eval: dict) -> bool:
        return self.depth is None or self.eval is None or self.step == last_eval.get("at_step")

    def kept_eval(self, last_eval: dict) -> dict:
        """The evaluation of the drafter written: the last state's, or the best one's."""
        return last_eval if self.is_last(last_eval) else self.eval

    def kept(self, drafter: Drafter, last_eval: dict) -> Drafter:
        """The drafter to write (rank 0): the last state, or the best one, read back from its folder."""
        return drafter if self.is_last(last_eval) else load_drafter(self.folder)

    def record(self, last_eval: dict) -> dict:
        """What the summary says of the drafter written."""
        if self.depth is None:
            return {"rule": "last", "step": last_eval.get("at_step")}
        kept = self.eval if self.eval is not None else last_eval
        return {
            "rule": f"best est. AL@{self.depth}",
            "step": kept.get("at_step"),
            "est_accept_len": self.value(kept),
            "last_step": last_eval.get("at_step"),
            "last_est_accept_len": self.value(last_eval),
        }
