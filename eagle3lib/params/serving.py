"""The params sections of serving: the engine and the benchmark."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from eagle3lib.params.schema import ComputeDtype, Section


class EngineParams(Section):
    name: Literal["vllm", "sglang"] = "vllm"
    python: str | None = Field(None, description="interpreter with the engine installed; default this one")
    host: str = "127.0.0.1"
    port: int | None = Field(None, ge=1, le=65535, description="default: a free port")
    start_timeout_s: float = Field(600, gt=0)
    extra_args: list[str] = []
    quick_start_args: list[str] = Field(
        [],
        description="flags added for the servers whose speed is not measured (the regeneration server, the deploy "
        "check), e.g. vLLM's --enforce-eager: on the CPU it starts in ~45 s against ~110-240 s compiled",
    )
    env: dict[str, str] = {}

    def for_quick_start(self) -> EngineParams:
        """This engine with quick_start_args added: for a server that is used, not benchmarked."""
        return self.model_copy(update={"extra_args": [*self.extra_args, *self.quick_start_args]})


# bench.prompts' named sets (speedup/prompt_sets.py reads them; a test keeps the two in step)
PROMPT_SET_NAMES = ("held_out", "mt_bench", "humaneval")


class BenchParams(Section):
    depths: list[int] = Field([16, 10, 5], description="the user's depths: measured, or predicted (asked_depths)")
    asked_depths: Literal["measure", "quick", "predict"] = Field(
        "measure",
        description="how bench.depths are answered when the cost model runs (pick_depth): measure (every prompt, "
        "every concurrency), quick (quick_prompts prompts at the lowest concurrency) or predict (the calibrated "
        "cost model only: no server). Without the cost model they are measured",
    )
    neighbours: bool = Field(True, description="also measure the pick's neighbours at the lowest concurrency")
    pick_depth: bool = Field(
        True,
        description="also measure the depth the cost model predicts fastest at each concurrency and its "
        "neighbours (needs the training eval's acceptance; speedup/cost.py)",
    )
    max_depth: int = Field(16, ge=1, description="the deepest chain the cost model considers")
    quick_below: float = Field(
        0.75,
        ge=0,
        description="a depth predicted below this speedup at every concurrency runs quick_prompts prompts only",
    )
    quick_prompts: int = Field(8, gt=0, description="prompts for a depth predicted to lose by a wide margin")
    concurrency: list[int] = [1, 8]
    prompts: list[str] = Field(
        ["held_out"],
        description="the prompt sets, each labelled by its name: held_out (the prepare stage's bench split), "
        "mt_bench and humaneval (shipped in PyPI packages), or a JSONL file in EAGLE's question format (a path, "
        "relative to the params file's folder), e.g. ../shared/benchsets/gsm8k/question.jsonl (speedup/prompt_sets.py)",
    )
    num_prompts: int = Field(16, gt=0, description="questions per set (an MT-Bench question is two requests)")
    context_lengths: list[int] = Field(
        [],
        description="long-context prompts of up to these many tokens, made of held-out conversations, for AL "
        "against context length; measured at the lowest concurrency (empty: none)",
    )
    context_prompts: int = Field(2, gt=0, description="prompts per context length")
    max_tokens: int = Field(128, gt=0)
    temperature: float = Field(
        0.0, ge=0, description="0: greedy, exact losslessness; > 0: sampled, lossless checked in distribution"
    )
    top_p: float = Field(1.0, gt=0, le=1)
    samples: int = Field(
        64, ge=0, description="with temperature > 0: samples per prompt for the distribution check (0: no check)"
    )
    sample_prompts: int = Field(2, gt=0, description="prompts of the distribution check")
    sample_tokens: int = Field(24, gt=0, description="tokens per sample of the distribution check")
    sample_alpha: float = Field(
        0.01, gt=0, lt=1, description="the distribution check fails below this p-value (speedup/sampling.py)"
    )
    replay_prompts: int = Field(
        4,
        ge=1,
        description="prompts whose speculative decoding is replayed with the HF "
        "target to colour each token by its origin (~10 s per prompt and depth on 2 cores)",
    )
    schedule: bool = Field(
        True,
        description="derive the depth per load from the fixed configurations' measurements, deploy it as the "
        "engine's own schedule (vLLM's per-batch-size tokens, SGLang's adaptive config) and measure it like them",
    )
    slo_itl_p90_ms: float | None = Field(
        None,
        gt=0,
        description="the schedule's latency target: at each load, the fastest configuration whose p90 inter-token "
        "latency is within it (needs load_prompts > 0); null: the fastest",
    )
    load_prompts: int = Field(
        32,
        ge=0,
        description="first-turn prompts each configuration serves at every load point through the engine's own "
        "serving benchmark, for time to first token and inter-token latency percentiles (0: no load sweep)",
    )
    load_rates: list[float] = Field(
        [],
        description="Poisson request rates (requests/s) served after the closed-loop points at each concurrency, "
        "capped at the highest concurrency",
    )
    dtype: ComputeDtype | None = Field(
        None,
        description="engine --dtype for the benchmark; null = the engine's default (bf16 on CPU), auto = "
        "the machine's fast dtype. float32 "
        "checks losslessness token for token (bf16 kernels round differently per batch shape)",
    )

    @field_validator("prompts")
    @classmethod
    def _prompt_sets(cls, v):
        if not v:
            raise ValueError("expected at least one prompt set")
        for entry in v:
            if entry not in PROMPT_SET_NAMES and not entry.endswith((".jsonl", ".jsonl.gz", ".json")):
                raise ValueError(
                    f"unknown prompt set {entry!r}: expected one of {list(PROMPT_SET_NAMES)} or a path to a JSONL "
                    f"file in EAGLE's question format"
                )
        return v

    @model_validator(mode="after")
    def _latency_target_needs_latencies(self):
        if self.slo_itl_p90_ms is not None and self.load_prompts == 0:
            raise ValueError(
                "bench.slo_itl_p90_ms needs inter-token latencies, which the load sweep measures: set "
                "bench.load_prompts above 0, or drop the target"
            )
        return self

    @field_validator("context_lengths", "load_rates")
    @classmethod
    def _positive_amounts(cls, v, info):
        if any(x <= 0 for x in v):
            what = {"context_lengths": "token counts", "load_rates": "request rates (requests/s)"}[info.field_name]
            raise ValueError(f"expected positive {what}, got {v}")
        return v

    @field_validator("depths", "concurrency")
    @classmethod
    def _positive(cls, v):
        if not v or any(x <= 0 for x in v):
            raise ValueError(f"expected a non-empty list of positive integers, got {v}")
        return v
