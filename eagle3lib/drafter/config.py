"""The drafter's shape: DrafterConfig (dims, the EAGLE-3.1 norm flags, the layer's attention kind and its MLA dims),
made from the target's config and read from / written to a checkpoint's config.json (Llama's keys, or DeepSeek's
for an MLA layer)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from torch import nn
from transformers import LlamaConfig

from eagle3lib.drafter.attention import ATTENTIONS
from eagle3lib.drafter.mla import MLA_ARCHITECTURE, MLA_DIMS

ARCHITECTURE = "LlamaForCausalLMEagle3"
VARIANTS = ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")


def standard_rope(rope: dict) -> dict:
    """Rope parameters with the rope's kind under rope_type only ("type" is the older key of DeepSeek's and
    TorchSpec's configs, which transformers keeps beside it), so a config reads back equal to itself."""
    rope = dict(rope)
    kind = rope.pop("type", None)
    rope.setdefault("rope_type", kind or "default")
    return rope


@dataclass
class DrafterConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]  # HF hidden_states indexing (docs/design.md §4)
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    # EAGLE-3.1's norms (speculators' eagle3 defaults turn on the first three): all off is the original EAGLE-3.
    norm_before_fc: bool = False  # one RMSNorm over the concatenated aux states before fc
    fc_norm: bool = False  # an RMSNorm per aux state before fc (exclusive with norm_before_fc)
    norm_output: bool = False  # the next chain step takes norm(h), not the pre-norm h
    norm_before_residual: bool = False  # the layer's residual is hidden_norm(h), not h
    # The layer's attention (ATTENTIONS): gqa = Llama's q/k/v heads; mla = DeepSeek's multi-head latent attention,
    # with these dims (drafter/mla.py; q_lora_rank None: q_proj reads the input directly). head_dim is then the
    # rotary's, qk_rope_head_dim, as DeepSeek's configs define it.
    draft_attention: str = "gqa"
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    def __post_init__(self):
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are exclusive: one norm over the aux states, or one each")
        if self.draft_attention not in ATTENTIONS:
            raise ValueError(f"draft_attention is one of {sorted(ATTENTIONS)}, not {self.draft_attention!r}")
        dims = {d: getattr(self, d) for d in MLA_DIMS}
        if self.draft_attention == "mla" and None in [v for d, v in dims.items() if d != "q_lora_rank"]:
            raise ValueError(
                f"an MLA drafter needs kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: {dims}"
            )
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank is None (q_proj reads the input) or positive, not {self.q_lora_rank}")
        if self.draft_attention == "gqa" and any(v is not None for v in dims.values()):
            raise ValueError(f"MLA dims on a gqa drafter: {dims}")

    @property
    def attention_class(self) -> type[nn.Module]:
        """The layer's attention module: the one place the gqa / mla choice is read."""
        return ATTENTIONS[self.draft_attention]

    @property
    def mla_dims(self) -> dict:
        return {d: getattr(self, d) for d in MLA_DIMS} if self.draft_attention == "mla" else {}

    @property
    def variants(self) -> dict[str, bool]:
        """The EAGLE-3.1 flags that are on."""
        return {f: True for f in VARIANTS if getattr(self, f)}

    @classmethod
    def from_target(
        cls,
        target_config,
        draft_vocab_size: int,
        aux_layer_ids: list[int],
        draft_attention: str = "gqa",
        mla: dict | None = None,
    ) -> DrafterConfig:
        """Dims default to the target's, as the engines expect. An MLA target (DeepSeek-V3, Kimi-K2.5) has no
        plain head size: a gqa drafter's Llama heads take its value head size (128 for Kimi, as the released
        Kimi drafters have). An mla drafter takes the target's MLA dims and heads where it has them, `mla`'s
        values ({dim: value}, None = the target's) where given; a dim neither has is an error naming it."""
        c = getattr(target_config, "text_config", None) or target_config
        if draft_attention == "mla":
            return cls.from_target(c, draft_vocab_size, aux_layer_ids).with_mla(c, mla or {})
        heads = c.num_attention_heads
        mla_head_dim = getattr(c, "v_head_dim", None) if getattr(c, "kv_lora_rank", None) else None
        rope = getattr(c, "rope_parameters", None) or {
            "rope_type": "default",
            "rope_theta": getattr(c, "rope_theta", 10000.0),
        }
        return cls(
            hidden_size=c.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=mla_head_dim or getattr(c, "head_dim", None) or c.hidden_size // heads,
            intermediate_size=c.intermediate_size,
            vocab_size=c.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=c.hidden_size,
            aux_layer_ids=list(aux_layer_ids),
            rms_norm_eps=c.rms_norm_eps,
            hidden_act=getattr(c, "hidden_act", "silu"),
            max_position_embeddings=getattr(c, "max_position_embeddings", 8192),
            rope_parameters=standard_rope(rope),
        )

    def with_mla(self, target_text_config, given: dict) -> DrafterConfig:
        """This config as an mla drafter: each MLA dim (and num_attention_heads) from `given` where not None,
        else the target's. A q_lora_rank is required although the layer can do without (q_proj): neither engine
        serves that (vLLM 0.32's loader stacks kv_a_proj_with_mqa into fused_qkv_a_proj, which only the low-rank
        q has: tests/e2e/test_mla_vllm.py; SGLang 0.5.17's kimi_k25_eagle3 raises without it)."""
        dims = {}
        for name in (*MLA_DIMS, "num_attention_heads"):
            value = given.get(name)
            if value is None:
                value = getattr(target_text_config, name, None)
            if value is None:
                why = "is null: no engine serves an MLA drafter without the low-rank q" if name == "q_lora_rank" else ""
                raise ValueError(
                    f"the target's config has no {name} ({why or 'it is not an MLA model'}): give it in train.mla.{name}"
                )
            dims[name] = value
        heads = dims.pop("num_attention_heads")
        return replace(
            self,
            draft_attention="mla",
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=dims["qk_rope_head_dim"],
            **dims,
        )

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            hidden_act=self.hidden_act,
            num_hidden_layers=1,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters),
            tie_word_embeddings=False,
        )

    def to_hf_dict(self) -> dict:
        """config.json of the canonical checkpoint: flat Llama fields plus the EAGLE-3 ones; an mla drafter's is
        TorchSpec's Eagle3DeepseekV2ForCausalLM config (mla_hf_dict)."""
        if self.draft_attention == "mla":
            return self.mla_hf_dict()
        d = self.llama_config().to_dict()
        d.update(
            architectures=[ARCHITECTURE],
            model_type="llama",
            draft_vocab_size=self.draft_vocab_size,
            target_hidden_size=self.target_hidden_size,
            num_hidden_layers=1,
            tie_word_embeddings=False,
            eagle_config={
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                "aux_layer_id_convention": "hf_hidden_states",
            },
            **self.variants,
        )
        return d

    def mla_hf_dict(self) -> dict:
        """TorchSpec's keys (its Kimi-K2.5 MLA drafter's config.json), the rope as rope_theta + rope_scaling, plus
        ours: target_hidden_size, the aux ids' convention, EAGLE-3.1's flags. model_type deepseek_v2: a config class
        every engine's transformers knows (kimi_k2, TorchSpec's, only vLLM's registry does), which vLLM does not take
        for DeepSeek's MTP head as it takes deepseek_v3 (SpeculativeConfig.hf_config_override)."""
        scaling = {k: v for k, v in self.rope_parameters.items() if k != "rope_theta"}
        return {
            "architectures": [MLA_ARCHITECTURE],
            "model_type": "deepseek_v2",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            **self.mla_dims,
            "head_dim": self.qk_rope_head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_parameters.get("rope_theta", 10000.0),
            "rope_scaling": None if scaling.get("rope_type", "default") == "default" else scaling,
            "tie_word_embeddings": False,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                "aux_layer_id_convention": "hf_hidden_states",
            },
            **self.variants,
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> DrafterConfig:
        rope = d.get("rope_parameters") or {"rope_theta": d.get("rope_theta", 10000.0), **(d.get("rope_scaling") or {})}
        heads = d["num_attention_heads"]
        mla = MLA_ARCHITECTURE in (d.get("architectures") or [])
        return cls(
            hidden_size=d["hidden_size"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=(d["qk_rope_head_dim"] if mla else d.get("head_dim")) or d["hidden_size"] // heads,
            intermediate_size=d["intermediate_size"],
            vocab_size=d["vocab_size"],
            draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
            target_hidden_size=d.get("target_hidden_size") or d["hidden_size"],
            aux_layer_ids=list(d["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
            rms_norm_eps=d["rms_norm_eps"],
            hidden_act=d.get("hidden_act", "silu"),
            max_position_embeddings=d.get("max_position_embeddings", 8192),
            rope_parameters=standard_rope(rope),
            **{f: bool(d.get(f, False)) for f in VARIANTS},
            **({"draft_attention": "mla", **{k: d.get(k) for k in MLA_DIMS}} if mla else {}),
        )

    def as_dict(self) -> dict:
        return asdict(self)
