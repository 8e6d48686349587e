"""The draft layer's attention, chosen once per drafter config: GQA or MLA. Each kind is an object that knows its
architecture, the config keys it needs, its tensors and their shapes; formats.py, convert/layouts.py and
convert/gate.py ask the object instead of branching on its name.

    gqa  Llama's grouped-query attention: q/k/v/o_proj over the 2H input. SGLang's and vLLM's llama_eagle3
         (LlamaForCausalLMEagle3) serve it.
    mla  DeepSeek-V2's multi-latent attention: q_a_proj (LoRA down) -> q_a_layernorm -> q_b_proj, kv_a_proj_with_mqa
         (latent + the shared rope key) -> kv_a_layernorm -> kv_b_proj, o_proj over the value heads; the down
         projections take the 2H input. Eagle3DeepseekV2ForCausalLM serves it: SGLang 0.5.17 kimi_k25_eagle3.py
         (Eagle3MLADecoderLayer: fused_qkv_a_proj_with_mqa = ReplicatedLinear(2 * hidden_size, q_lora_rank +
         kv_lora_rank + qk_rope_head_dim)) and vLLM deepseek_eagle3.py (DeepseekV2MLAAttention(input_size=2 *
         hidden_size)). TorchSpec trains it for Kimi-K2.5 (its kimi_k25_eagle3_mla.json).

Tensor names are the canonical ones (layers.0.*, fc, norm, lm_head, d2t, t2d), shapes [out, in] as nn.Linear keeps
them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# The tensors every kind's layer has besides its attention, and the ones outside the layer.
NORM_TENSORS = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight")
MLP_TENSORS = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
TOP_TENSORS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")
LAYER = "layers.0."


def _gqa_attention(c: dict) -> dict[str, tuple]:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv, hd = c.get("num_key_value_heads") or heads, c.get("head_dim") or c["hidden_size"] // heads
    return {
        "self_attn.q_proj.weight": (heads * hd, 2 * h),
        "self_attn.k_proj.weight": (kv * hd, 2 * h),
        "self_attn.v_proj.weight": (kv * hd, 2 * h),
        "self_attn.o_proj.weight": (h, heads * hd),
    }


def _mla_attention(c: dict) -> dict[str, tuple]:
    h, heads, q_rank, kv_rank = c["hidden_size"], c["num_attention_heads"], c.get("q_lora_rank"), c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    if q_rank:  # LoRA-compressed queries, as Kimi-K2.5 and DeepSeek-V3 have them
        q = {
            "self_attn.q_a_proj.weight": (q_rank, 2 * h),
            "self_attn.q_a_layernorm.weight": (q_rank,),
            "self_attn.q_b_proj.weight": (heads * (nope + rope), q_rank),
        }
    else:
        q = {"self_attn.q_proj.weight": (heads * (nope + rope), 2 * h)}
    return {
        **q,
        "self_attn.kv_a_proj_with_mqa.weight": (kv_rank + rope, 2 * h),
        "self_attn.kv_a_layernorm.weight": (kv_rank,),
        "self_attn.kv_b_proj.weight": (heads * (nope + v), kv_rank),
        "self_attn.o_proj.weight": (h, heads * v),
    }


@dataclass(frozen=True)
class LayerKind:
    name: str
    architecture: str  # architectures of the canonical config.json and of both engines' exports
    model_type: str  # the canonical config's model_type: what both engines parse the config as
    config_keys: tuple[str, ...]  # the attention's config keys a drafter config of this kind must carry
    attention: Callable[[dict], dict[str, tuple]]  # {attention tensor under layers.0.: shape} for a config
    speculators_refusal: str | None  # why the speculators layout cannot carry this kind; None: it can

    def shapes(self, config: dict, variants: dict | None = None, n_aux: int = 3) -> dict[str, tuple]:
        """{canonical tensor name: shape} of a drafter with this config and EAGLE-3.1 flags."""
        c = config
        h, inter = c["hidden_size"], c["intermediate_size"]
        ht = c.get("target_hidden_size") or h
        draft_vocab = c.get("draft_vocab_size") or c["vocab_size"]
        layer = dict.fromkeys(NORM_TENSORS, (h,))
        layer.update(self.attention(c))
        layer.update({MLP_TENSORS[0]: (inter, h), MLP_TENSORS[1]: (inter, h), MLP_TENSORS[2]: (h, inter)})
        out = {LAYER + n: s for n, s in layer.items()}
        out.update(
            {
                "fc.weight": (h, n_aux * ht),
                "norm.weight": (h,),
                "lm_head.weight": (draft_vocab, h),
                "d2t": (draft_vocab,),
                "t2d": (c["vocab_size"],),
            }
        )
        variants = variants or {}
        if variants.get("norm_before_fc"):
            out["input_norm.weight"] = (n_aux * ht,)
        if variants.get("fc_norm"):
            out.update({f"fc_norm.{i}.weight": (ht,) for i in range(n_aux)})
        return out

    def tensors(self, config: dict, variants: dict | None = None, n_aux: int = 3) -> tuple[str, ...]:
        return tuple(self.shapes(config, variants, n_aux))

    def missing_keys(self, config: dict) -> list[str]:
        return [k for k in self.config_keys if k not in config]


GQA = LayerKind(
    name="gqa",
    architecture="LlamaForCausalLMEagle3",
    model_type="llama",
    config_keys=("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"),
    attention=_gqa_attention,
    speculators_refusal=None,
)
MLA = LayerKind(
    name="mla",
    architecture="Eagle3DeepseekV2ForCausalLM",
    # vLLM (config/speculative.py hf_config_override) turns a draft of model_type deepseek_v3 into its MTP model;
    # deepseek_v2 is left an EAGLE-3 draft, and every transformers here knows it (TorchSpec's kimi_k2 only the
    # engines' registries do). drafter/model.py's DrafterConfig.mla_hf_dict writes the same.
    model_type="deepseek_v2",
    config_keys=(
        "hidden_size",
        "num_attention_heads",
        "intermediate_size",
        "vocab_size",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
    ),
    attention=_mla_attention,
    speculators_refusal=(
        "the speculators format has no MLA draft layer: speculators 0.9.0 builds eagle3 layers for the model types "
        "llama and qwen3 only (speculators/models/eagle3/model_definitions.py model_classes), and vLLM reads a "
        "speculators eagle3 config only for those (vllm/transformers_utils/configs/speculators/algos.py "
        "update_eagle3: 'Unsupported model_type ... for Eagle3 speculator'). Export it for sglang or vllm"
    ),
)
KINDS = (GQA, MLA)
# Architectures that name an MLA drafter: the vLLM alias too (deepseek_eagle3.py Eagle3DeepseekV3ForCausalLM).
MLA_ARCHITECTURES = (MLA.architecture, "Eagle3DeepseekV3ForCausalLM")


def layer_kind(config: dict) -> LayerKind:
    """The kind of a drafter config of any layout: MLA when its architectures name the MLA drafter or its layer
    config has MLA's latent rank (kv_lora_rank), else GQA."""
    layer = config.get("transformer_layer_config") or config
    if any(a in MLA_ARCHITECTURES for a in config.get("architectures") or []) or layer.get("kv_lora_rank"):
        return MLA
    return GQA
