"""Params: a params file's every section, and the checks that read more than one section."""

from __future__ import annotations

from pydantic import Field, model_validator

from eagle3lib.params.schema import DataParams, ExtractParams, RunParams, Section, TargetParams, TrainParams
from eagle3lib.params.serving import BenchParams, EngineParams


class Params(Section):
    run: RunParams
    target: TargetParams = TargetParams()
    data: DataParams = DataParams()
    extract: ExtractParams = ExtractParams()
    train: TrainParams = TrainParams()
    engine: EngineParams = EngineParams()
    bench: BenchParams = BenchParams()

    file: str | None = Field(None, exclude=True, description="the params file this came from")
    overrides: dict = Field(
        default_factory=dict,
        exclude=True,
        description="the overrides applied to it (a process started for a stage loads the same)",
    )
    dtype_choices: dict = Field(
        {}, exclude=True, description="'section.dtype' -> {auto, picked, why} for each dtype given as auto"
    )

    @model_validator(mode="after")
    def _online_writes_no_states(self):
        # online training captures its own states: 01_extract writes none unless the params name its splits
        if self.train.source == "online" and "splits" not in self.extract.model_fields_set:
            self.extract.splits = []
        return self

    @model_validator(mode="after")
    def _online_capture_backend(self):
        if self.train.source != "online":
            return self
        backend, train = self.extract.backend, self.train
        if backend not in ("hf", "sglang_inprocess"):
            raise ValueError(
                f"train.source: online captures with extract.backend hf (the target in the trainer's process) or "
                f"sglang_inprocess (SGLang's model runner in the trainer's process, on GPUs); {backend!r} serves "
                "states over HTTP and is not wired to online training: set one of those, or train.source: shards"
            )
        if backend == "sglang_inprocess" and train.online_placement == "thread" and train.nproc_per_node > 1:
            raise ValueError(
                "train.source: online with extract.backend sglang_inprocess in a thread runs SGLang's model runner in "
                "one trainer process (its tensor-parallel ranks on the engine's GPUs, the trainer on the first): set "
                f"train.nproc_per_node: 1 (not {train.nproc_per_node}), or train.online_placement: process for "
                "several trainers beside one capture process"
            )
        return self

    @classmethod
    def section_names(cls) -> list[str]:
        """The params file's top-level sections (not the bookkeeping fields file and dtype_choices)."""
        return [k for k, f in cls.model_fields.items() if not f.exclude]

    def section_dict(self, *names: str) -> dict:
        return {n: getattr(self, n).model_dump(mode="json") for n in names}

    def resolved(self) -> dict:
        return self.model_dump(mode="json")
