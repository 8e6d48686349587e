"""The EAGLE-3 draft model, shaped as SGLang's and vLLM's `llama_eagle3.py` serve it.

    fc:      Linear(3·H_target → H) over the concatenated aux states of the target
    layer:   one Llama decoder layer whose attention reads concat(input_layernorm(embed), hidden_norm(h)),
             i.e. q/k/v take 2H, with the residual taken from h
    norm:    final RMSNorm; logits = lm_head(norm(h)) over the draft vocabulary
    output:  the pre-norm hidden state, which the next draft step takes as its h

Token embeddings are the target's (frozen, not part of the checkpoint); d2t maps
draft ids to target ids (target = draft + d2t[draft]); t2d marks target ids in
the draft vocabulary.

Two ways to run it, which must agree (tests/unit/test_drafter.py):
- `ttt_forward`: training-time test, all K chain steps for every position at
  once; step k's query at position t+k attends to step-0 keys at positions ≤ t
  (same document) and to the keys of steps 1..k at the same t.
- `DraftCache` + `step`: the chain as engines run it, one token at a time with
  a KV cache, feeding the draft its own hidden states.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from eagle3lib.drafter.mla import MLA_ARCHITECTURE, MLA_DIMS, MLAAttention
from eagle3lib.drafter.ttt_attention import (
    HALF_DTYPES,
    TTT_BLOCK,
    RowLayout,
    auto_attention,
    causal_attention_with_diagonals,
    dense_prefix_mask,
    dense_ttt_attention,
    flex_attention_on_device,
    row_layout,
    ttt_block_masks,
)

ARCHITECTURE = "LlamaForCausalLMEagle3"
VARIANTS = ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q, k, cos, sin):
    """Llama's rotary embedding on q, k [B,heads,T,d] with cos, sin [B,T,d]: transformers' apply_rotary_pos_emb,
    written here because that one dispatches through a variable that `kernels` makes process-wide once anything
    compiles, which the hf capture's thread sets mid-forward while the trainer compiles (train.source online)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


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


class Attention(nn.Module):
    """Llama attention over a 2H input; the caller supplies keys/values to attend to and the mask."""

    TARGET_LAYER = "a Llama-shaped target layer"  # what init_from_target_layer maps

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    @staticmethod
    def rotary_embedding(cfg: DrafterConfig) -> nn.Module:
        return LlamaRotaryEmbedding(cfg.llama_config())

    INPUT_PROJECTIONS = ("q_proj", "k_proj", "v_proj")  # the linear maps of the layer's 2H input

    def input_weight(self) -> torch.Tensor:
        """[(h+2kv)·d, 2H]: the q, k and v projections of the layer's input, stacked."""
        return torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])

    def heads_from_input(self, qkv, cos, sin):
        """F.linear(x, input_weight()) [B,T,(h+2kv)·d] → q [B,h,T,d], k, v [B,kv,T,d], rotary applied."""
        q, k, v = qkv.split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], -1
        )
        return self.heads_with_rope(q, k, v, cos, sin)

    def qkv(self, x, cos, sin):
        return self.heads_with_rope(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin)

    def heads_with_rope(self, q, k, v, cos, sin):
        """[B,T,h·d] projections → q [B,h,T,d], k, v [B,kv,T,d], rotary applied to q and k."""
        b, t, _ = q.shape
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        return q, k, v

    def output(self, out):
        """o_proj over attention outputs [B,h,T,d]."""
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))

    def attend(self, q, k, v, mask):
        """q [B,h,T,d]; k, v [B,kv,S,d]; mask bool [B,T,S] (True = may attend)."""
        return self.output(
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=self.heads != self.kv_heads)
        )


ATTENTIONS = {"gqa": Attention, "mla": MLAAttention}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        llama = cfg.llama_config()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = cfg.attention_class(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(llama)

    def attn_input(self, embeds, hidden):
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    # q/k/v read concat(input_layernorm(embed), hidden_norm(h)), so each projection is the sum of an
    # embedding half (weight columns :H) and a hidden half (H:). In TTT, step k at t reads the embedding
    # of token t+1+k, the same rows shifted by k: the embedding half is projected once for all steps.
    def qkv_weight_halves(self):
        w, h = self.self_attn.input_weight(), self.hidden_norm.weight.shape[0]
        return w[:, :h], w[:, h:]

    def embed_qkv(self, embeds, w_embed):
        return F.linear(self.input_layernorm(embeds), w_embed)

    def step_qkv(self, embed_part, hidden, w_hidden, cos, sin):
        """q, k, v of one TTT step from its slice of embed_qkv and the step's hidden state."""
        return self.self_attn.heads_from_input(embed_part + F.linear(self.hidden_norm(hidden), w_hidden), cos, sin)

    def finish(self, attn_out, hidden):
        """Residual from h (hidden_norm(h) with norm_before_residual), then post-attention norm and MLP; returns
        the pre-norm output state."""
        h = (self.hidden_norm(hidden) if self.norm_before_residual else hidden) + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        n_aux = len(cfg.aux_layer_ids)
        self.fc = nn.Linear(n_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        if cfg.norm_before_fc:
            self.input_norm = LlamaRMSNorm(n_aux * cfg.target_hidden_size, eps=cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(
                [LlamaRMSNorm(cfg.target_hidden_size, eps=cfg.rms_norm_eps) for _ in range(n_aux)]
            )
        self.layers = nn.ModuleList([DecoderLayer(cfg)])
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary = cfg.attention_class.rotary_embedding(cfg)
        self.compile_merge = False  # ttt_forward's merged attention: its merge torch.compile'd (train.compile_layer)

    @property
    def layer(self) -> DecoderLayer:
        return self.layers[0]

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """fc over the target's concatenated aux states, after their norm(s) where the config has them."""
        if self.cfg.norm_before_fc:
            aux = self.input_norm(aux)
        elif self.cfg.fc_norm:
            aux = torch.cat([norm(a) for norm, a in zip(self.fc_norm, aux.chunk(len(self.fc_norm), -1))], -1)
        return self.fc(aux)

    def next_state(self, out: torch.Tensor) -> torch.Tensor:
        """What the next chain step takes as its hidden state: the layer's pre-norm output, or with
        norm_output its final norm (the logits read norm(out) either way)."""
        # in out's dtype: the norm's fp32 weight would promote a bf16 state, and the rope then makes q/k fp32
        return self.norm(out).to(out.dtype) if self.cfg.norm_output else out

    def rope(self, x, position_ids):
        return self.rotary(x, position_ids)

    @torch.no_grad()
    def init_from_target_layer(self, layer: dict, top_aux: int = -1) -> None:
        """Start as the target's layer `layer` ({name within the layer: tensor}, target.load_layer_tensors)
        applied to one aux state: fc passes aux state `top_aux` through unchanged, the projections of the layer's
        input read only the hidden half (the embedding half starts at zero), and the norms, the rest of the
        attention and the MLP are the target's. So before training the drafter is an early exit from the target's
        top aux layer through its last layer. The target's layer must be shaped as the drafter's attention names
        (TARGET_LAYER): Llama's for gqa; DeepSeek's MLA with a dense MLP for mla (an MoE layer, as Kimi-K2.5's
        last, does not map)."""
        mine = self.layer
        h = mine.hidden_norm.weight.shape[0]
        wanted = {
            **{"self_attn." + n: p for n, p in mine.self_attn.named_parameters()},
            "mlp.gate_proj.weight": mine.mlp.gate_proj.weight,
            "mlp.up_proj.weight": mine.mlp.up_proj.weight,
            "mlp.down_proj.weight": mine.mlp.down_proj.weight,
            "input_layernorm.weight": mine.hidden_norm.weight,
            "post_attention_layernorm.weight": mine.post_attention_layernorm.weight,
        }
        for name, param in wanted.items():
            theirs = layer.get(name)
            half = param[:, h:] if name.split(".")[-2] in mine.self_attn.INPUT_PROJECTIONS else param
            if theirs is None or theirs.shape != half.shape:
                got = "missing" if theirs is None else tuple(theirs.shape)
                raise ValueError(
                    f"cannot start the drafter from the target's layer: {name} is {got}, the drafter's is "
                    f"{tuple(half.shape)}; this needs {mine.self_attn.TARGET_LAYER} (set "
                    "train.init_layer_from_target false for other architectures)"
                )
            if half is not param:
                param[:, :h].zero_()
            half.copy_(theirs)
        n_aux = len(self.cfg.aux_layer_ids)
        top = top_aux % n_aux
        if self.cfg.target_hidden_size != self.cfg.hidden_size:
            raise ValueError("fc passes an aux state through only when the drafter's hidden size is the target's")
        self.fc.weight.zero_()
        self.fc.weight[:, top * h : (top + 1) * h] = torch.eye(h)

    # ---------------------------------------------------------- training ----
    def ttt_forward(
        self,
        aux,
        embeds,
        position_ids,
        doc_ids,
        attention: str = "auto",
        checkpoint: bool = False,
        layout: RowLayout | None = None,
    ):
        """Training-time test over K chain steps.

        aux [B,T,3H_t]: target aux states at each position t.
        embeds [B,T+K-1,H]: embeddings of the tokens fed along the chain: step k at position t
            takes embeds[:, t+k] (the ground-truth token t+1+k). K = embeds' length - T + 1.
        position_ids [B,T]: positions within each document; doc_ids [B,T]: document
            of each position in a packed row (-1 = padding).
        Returns the pre-norm hidden states of each step, [B,T,H] each (logits: self.logits); the next step
        takes next_state of each.

        Step k's query at t attends to the step-0 keys at s ≤ t (same document) and to
        the step-1..k keys at t itself (drafter/ttt_attention.py). attention:
        - "dense" scores those diagonals as dot products beside one T×T block (simple;
          memory grows with T², fine on the CPU);
        - "flex" runs flex_attention with a block mask, which never materializes T×T
          scores and skips other documents' blocks;
        - "merged": a fused causal kernel over step 0's keys, merged with the diagonals by
          log-sum-exp (causal_attention_with_diagonals): cuDNN's for rows of one document
          (then padding), flash attention's variable-length kernel for packed rows; fp16/bf16 on GPUs;
        - "varlen": merged with the variable-length kernel whatever the rows (an ablation);
        - "auto": on CUDA merged in fp16/bf16, flex in fp32; dense elsewhere (auto_attention).
        checkpoint: keep each step's inputs and recompute the step in the backward pass
        instead of holding its activations (MLP, norms) for all K steps.
        layout: row_layout(doc_ids) made on the host (else made here from doc_ids, which waits for the GPU).
        """
        b, t = aux.shape[:2]
        steps = embeds.shape[1] - t + 1
        if steps < 1:
            raise ValueError(f"embeds has {embeds.shape[1]} positions for {t} aux positions: expected T+K-1 ≥ T")
        half = torch.is_autocast_enabled("cuda") or self.fc.weight.dtype in HALF_DTYPES
        if attention == "auto":
            attention = auto_attention(aux.is_cuda, half)
        elif attention in ("merged", "varlen") and aux.is_cuda and not half:
            raise ValueError(
                f"attention={attention!r} runs cuDNN or flash attention, which take fp16/bf16 only; "
                "use 'flex' or 'dense' in fp32"
            )
        segments = None
        if attention in ("merged", "varlen"):
            layout = layout or row_layout(doc_ids)
            if attention == "varlen" or not layout.one_document:
                attention, segments = "merged", layout.segments
        attn, layer = self.layer.self_attn, self.layer
        groups = attn.heads // attn.kv_heads
        w_embed, w_hidden = layer.qkv_weight_halves()
        embed_qkv = layer.embed_qkv(embeds, w_embed)  # [B,T+K-1,(h+2kv)·d], once
        if attention == "flex":
            t_pad = -(-t // TTT_BLOCK) * TTT_BLOCK  # each step's keys fill whole blocks (ttt_block_masks)
            masks = ttt_block_masks(F.pad(doc_ids, (0, t_pad - t), value=-1), t, steps)
            keep = lambda k, x: F.pad(x, (0, 0, 0, t_pad - t))  # noqa: E731
        elif attention == "merged" and segments is None:
            keep = lambda k, x: x.repeat_interleave(groups, 1) if k == 0 else x  # noqa: E731 (cuDNN takes h heads)
        elif attention == "merged":
            keep = lambda k, x: x  # noqa: E731 (flash varlen takes the kv heads)
        elif attention == "dense":
            prefix_mask = dense_prefix_mask(doc_ids)
            keep = lambda k, x: x.repeat_interleave(groups, 1)  # noqa: E731
        else:
            raise ValueError(f"attention must be auto, dense, flex, merged or varlen, not {attention!r}")

        def attend(k, q, keys, values):
            if attention == "flex":
                return flex_attention_on_device(
                    q, torch.cat(keys, 2), torch.cat(values, 2), block_mask=masks[k], enable_gqa=groups > 1
                )
            if attention == "merged":
                return causal_attention_with_diagonals(
                    q, keys[0], values[0], keys[1:], values[1:], compiled=self.compile_merge, segments=segments
                )
            return dense_ttt_attention(q, keys, values, prefix_mask)

        def one_step(k, hidden, *cached):
            cos, sin = self.rope(hidden, position_ids + k)
            q, key, value = layer.step_qkv(embed_qkv[:, k : k + t], hidden, w_hidden, cos, sin)
            key, value = keep(k, key), keep(k, value)
            keys, values = cached[: len(cached) // 2] + (key,), cached[len(cached) // 2 :] + (value,)
            return layer.finish(attn.output(attend(k, q, keys, values)), hidden), key, value

        hidden = self.project(aux)
        keys, values, outputs = [], [], []
        for k in range(steps):
            if checkpoint:
                out, key, value = torch.utils.checkpoint.checkpoint(
                    one_step, k, hidden, *keys, *values, use_reentrant=False
                )
            else:
                out, key, value = one_step(k, hidden, *keys, *values)
            keys.append(key)
            values.append(value)
            outputs.append(out)
            hidden = self.next_state(out)
        return outputs

    # --------------------------------------------------------- inference ----
    def step(self, cache: DraftCache, embeds, hidden, position_ids, from_target: bool):
        """Append n entries (embeds [B,n,H], positions [B,n]) to the cache, attending causally to
        everything cached. hidden is the target's concatenated aux states [B,n,3H_t] when
        from_target (the first step after verification), else the draft's own output [B,n,H].
        Returns (the state the next step takes [B,n,H] (next_state), logits [B,n,V_draft])."""
        if from_target:
            hidden = self.project(hidden)
        attn, layer = self.layer.self_attn, self.layer
        cos, sin = self.rope(hidden, position_ids)
        q, key, value = attn.qkv(layer.attn_input(embeds, hidden), cos, sin)
        cache.append(key, value, position_ids)
        mask = cache.positions[:, None, :] <= position_ids[:, :, None]
        out = layer.finish(attn.attend(q, cache.keys, cache.values, mask), hidden)
        return self.next_state(out), self.logits(out)


class DraftCache:
    """The draft's KV cache for one chain, as an engine keeps it."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None

    def append(self, key, value, positions):
        if self.keys is None:
            self.keys, self.values, self.positions = key, value, positions
        else:
            self.keys = torch.cat([self.keys, key], 2)
            self.values = torch.cat([self.values, value], 2)
            self.positions = torch.cat([self.positions, positions], 1)
