"""The extraction sized to its minutes here (extract.max_minutes) or to a number of training tokens
(extract.max_train_tokens), or both. With minutes, the validation split is extracted first, at the rate this machine
manages, and the training split is cut to the first sequences that fit the rest of the minutes at that rate: a short
fine-tune reads a fraction of what a whole extraction writes (on a CPU without native bf16: 380 s for 101,379
tokens, of which one minute of training read 39,647). With tokens, the training split keeps its first sequences
within that many tokens: the same data at several sizes, each a prefix of the next (a data-scaling comparison).

The cut is written to sizing.json in the stage folder before the training split's extraction starts, and a rerun
(killed, or a damaged shard redone) reads it back instead of measuring again, so the shards always hold the same
sequences. It applies to the backends that extract from this process (backends.ExtractHere).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3lib import run_folder

SIZING_FILE = "sizing.json"
FIRST, CUT = "val", "train"  # measured whole first; cut to what fits


def prefix(tokens: dict, sequences: int) -> dict:
    """A token file's first `sequences` sequences (conversations.load_tokens' dict)."""
    end = int(tokens["seq_starts"][sequences])
    out = {k: tokens[k][:end] for k in ("input_ids", "loss_mask")}
    out["seq_starts"] = tokens["seq_starts"][: sequences + 1]
    return out | {"ids": tokens["ids"][:sequences], "stats": tokens.get("stats", {})}


def fitting(seq_starts, token_budget: float) -> int:
    """The most leading sequences whose tokens fit token_budget (at least one, so the split is never empty)."""
    ends = seq_starts[1:].tolist()
    return max(1, sum(1 for end in ends if end <= token_budget))


@dataclass
class ExtractBudget:
    """backends.ExtractHere calls order() for the order of the splits and cut() on each split's tokens."""

    stage_dir: Path
    max_minutes: float | None = None
    max_train_tokens: int | None = None
    started: float | None = None  # when the first split began (time.perf_counter())
    decision: dict | None = None

    @property
    def file(self) -> Path:
        return Path(self.stage_dir) / SIZING_FILE

    def recorded(self) -> dict | None:
        """The cut an earlier run of this stage made with the same limits, if any."""
        if not self.file.is_file():
            return None
        rec = json.loads(self.file.read_text())
        same = (rec.get("max_minutes"), rec.get("max_train_tokens")) == (self.max_minutes, self.max_train_tokens)
        return rec if same else None

    def order(self, splits: list[str]) -> list[str]:
        return sorted(splits, key=lambda s: s != FIRST)

    def cut(self, split: str, tokens: dict, results: dict) -> dict:
        """`tokens`, or the leading sequences of the training split within max_train_tokens and that fit what is left
        of the minutes at the rate the validation split was extracted at (results: the splits extracted so far)."""
        if self.started is None:
            self.started = time.perf_counter()
        if split != CUT:
            return tokens
        total = len(tokens["seq_starts"]) - 1
        rec = self.recorded()
        if rec is not None and (rec["total_sequences"], rec["total_tokens"]) == (total, int(tokens["seq_starts"][-1])):
            self.decision = rec | {"resumed": True}
            self.decision["text"] = text(self.decision)  # the console says it was taken back, not timed now
            return prefix(tokens, rec["sequences"])
        keep = total
        if self.max_train_tokens is not None:
            keep = min(total, fitting(tokens["seq_starts"], self.max_train_tokens))
        rate, left = None, 0.0
        if self.max_minutes is not None:
            rate = (results.get(FIRST) or {}).get("tokens_per_s")
            left = self.max_minutes * 60 - (time.perf_counter() - self.started)
            if rate:  # else no validation split was extracted in this run to time: the minutes cut nothing
                keep = min(keep, fitting(tokens["seq_starts"], rate * left))
        self.decision = self._record(tokens, keep, rate, left)
        return prefix(tokens, keep)

    def _record(self, tokens: dict, keep: int, rate: float | None, left: float) -> dict:
        starts = tokens["seq_starts"]
        rec = {
            "max_minutes": self.max_minutes,
            "max_train_tokens": self.max_train_tokens,
            "sequences": keep,
            "total_sequences": len(starts) - 1,
            "tokens": int(starts[keep]),
            "total_tokens": int(starts[-1]),
            "tokens_per_s": None if rate is None else round(rate, 1),
            "seconds_left": round(left, 1),
        }
        rec["text"] = text(rec)
        run_folder.write_json(self.file, rec)
        return rec


def text(rec: dict) -> str:
    """The console's and the report's line: what the extraction was sized to, and why."""
    if rec.get("resumed"):
        return f"train split: the first {rec['sequences']:,} of {rec['total_sequences']:,} sequences, as sized before"
    whys = []
    if rec.get("max_train_tokens") is not None:
        whys.append(f"at most {rec['max_train_tokens']:,} tokens (extract.max_train_tokens)")
    if rec.get("max_minutes") is not None:
        minutes = f"{rec['max_minutes']:g} min (extract.max_minutes)"
        if rec["tokens_per_s"] is None:
            whys.append(f"{minutes} not applied: no validation split was timed in this run")
        else:
            whys.append(
                f"{rec['tokens_per_s']:,.0f} tokens/s on the validation split, {rec['seconds_left']:.0f} s left of {minutes}"
            )
    why = "; ".join(whys)
    if rec["sequences"] < rec["total_sequences"]:
        return (
            f"train split sized to its first {rec['sequences']:,} of {rec['total_sequences']:,} sequences "
            f"({rec['tokens']:,} tokens): {why}"
        )
    return f"train split not cut: all {rec['total_sequences']:,} sequences fit ({why})"
