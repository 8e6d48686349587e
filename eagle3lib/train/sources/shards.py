"""train.source: shards. The states 01_extract wrote, read from disk (extract's ShardSet), in the order
batches.shard_sequences gives an epoch; every process trains."""

from __future__ import annotations

from eagle3lib import run_folder
from eagle3lib.extract.shards import ShardSet
from eagle3lib.train.runtime.batches import micro_batches, pack_val_rows, shard_sequences
from eagle3lib.train.sources.base import Placement, StageProcess


class ShardsSource:
    """01_extract's train and val shards as a BatchSource."""

    def __init__(self, run_dir, seed: int, prefetch_shards: int):
        run_folder.load_result(run_dir, "01_extract")
        self.train = ShardSet(run_folder.stage_dir(run_dir, "01_extract") / "train")
        self.val = ShardSet(run_folder.stage_dir(run_dir, "01_extract") / "val")
        self.contract = dict(self.train.contract)
        self.seed, self.prefetch_shards = seed, prefetch_shards

    def train_sequences(self, epoch: int, start: int = 0):
        return shard_sequences(self.train, self.seed, epoch, start, prefetch=self.prefetch_shards)

    def val_rows(self, train_params) -> list[dict]:
        return pack_val_rows(shard_sequences(self.val, self.seed, 0, shuffle=False), train_params)

    def stream(self, train_params, state: dict):
        return micro_batches(
            self.train_sequences,
            train_params,
            state["epoch"],
            state["micro_in_epoch"],
            state.get("sequence_in_epoch"),  # absent from checkpoints of older versions: packed again up to the index
        )

    def summary(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class FromShards(Placement):
    name = "shards"

    def open(self, proc: StageProcess, tokens: dict) -> ShardsSource:
        return ShardsSource(proc.run_dir, proc.p.run.seed, proc.p.train.prefetch_shards)
