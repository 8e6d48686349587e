"""DeepSeek's multi-head latent attention (MLA) as the EAGLE-3 draft layer's attention, shaped as vLLM's
`deepseek_eagle3.py` and SGLang's `kimi_k25_eagle3.py` serve it (`Eagle3DeepseekV2ForCausalLM`).

The input is the layer's concat(input_layernorm(embed), hidden_norm(h)), 2H wide, as for the GQA attention:

    q       = q_b_proj(q_a_layernorm(q_a_proj(x)))            (q_proj(x) when q_lora_rank is None)
    c, k_pe = kv_a_proj_with_mqa(x)                           [kv_lora_rank], [qk_rope_head_dim], one for all heads
    k_nope, v = kv_b_proj(kv_a_layernorm(c))                  per head [qk_nope_head_dim], [v_head_dim]
    k       = concat(k_nope, rope(k_pe)); q = concat(q_nope, rope(q_pe))

So after kv_b_proj it is multi-head attention with qk head dim qk_nope + qk_rope and v head dim v_head_dim; the
engines absorb kv_b_proj into q and o_proj to cache only [c, k_pe], which computes the same scores. The rope is
DeepSeek's: interleaved pairs (vLLM's is_neox_style=False) on the qk_rope_head_dim dims only, YaRN-scaled when the
rope parameters say so, and YaRN's mscale(factor, mscale_all_dim)² multiplies the softmax scale (both engines).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
ROPE_TYPES = ("default", "yarn")  # what both engines' DeepSeek rope computes for a draft (vLLM: deepseek_yarn)


def softmax_scale_factor(rope: dict) -> float:
    """What multiplies 1/sqrt(qk head dim) in the softmax: YaRN's mscale(factor, mscale_all_dim)², 0.1·m·ln(f) + 1
    squared, as vLLM's DeepseekV2MLAAttention, SGLang's DeepseekV2AttentionMLA and transformers' DeepSeek-V3 take it;
    1 without YaRN."""
    factor, m = rope.get("factor") or 1.0, rope.get("mscale_all_dim") or 0.0
    if rope.get("rope_type", "default") == "default" or factor <= 1.0:
        return 1.0
    return (0.1 * m * math.log(factor) + 1.0) ** 2


def rotate_interleaved(x, cos, sin):
    """DeepSeek's rope: pairs (x0, x1), (x2, x3), ... each rotated by one frequency; cos/sin [B,T,d] are
    cat(freqs, freqs) as the rotary embedding returns them (its first half is each pair's angle)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :, :half], sin[:, None, :, :half]  # [B,1,T,d/2]: every head
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)


class MLAAttention(nn.Module):
    """MLA over the layer's 2H input; the same interface as the GQA Attention (drafter/model.py): `input_weight`
    (the linear maps that read the input, whose embedding and hidden halves TTT splits), `heads_from_input`, `qkv`,
    `output`, `attend`, and `rotary_embedding` for the Drafter. Keys and values have q's heads (kv_heads = heads)."""

    TARGET_LAYER = "a DeepSeek-shaped target layer (MLA of the drafter's dims, a dense MLP: not an MoE layer)"

    def __init__(self, cfg):
        super().__init__()
        self.heads = self.kv_heads = cfg.num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_head_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_head_dim = self.nope_dim + self.rope_dim
        x_dim, eps = 2 * cfg.hidden_size, cfg.rms_norm_eps  # the engines' q_a/kv_a norms take the model's eps
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(x_dim, self.heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(x_dim, self.q_lora_rank, bias=False)
            self.q_a_layernorm = LlamaRMSNorm(self.q_lora_rank, eps=eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(x_dim, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = LlamaRMSNorm(self.kv_lora_rank, eps=eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.heads * (self.nope_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_head_dim, cfg.hidden_size, bias=False)
        # the linear maps of the layer's 2H input, in the engines' fused order (fused_qkv_a_proj)
        self.INPUT_PROJECTIONS = ("q_proj" if self.q_lora_rank is None else "q_a_proj", "kv_a_proj_with_mqa")
        # Every TTT kernel scales scores by 1/sqrt(q's last dim); q carries the rest of the softmax scale (YaRN's
        # mscale², 1 without YaRN), so no kernel needs to know it.
        self.q_scale = softmax_scale_factor(cfg.rope_parameters)

    @staticmethod
    def rotary_embedding(cfg) -> nn.Module:
        """cos/sin over the qk_rope_head_dim dims, YaRN's frequencies and attention factor included."""
        rope = dict(cfg.rope_parameters)
        if rope.get("rope_type", "default") not in ROPE_TYPES:
            raise ValueError(f"an MLA drafter's rope is one of {ROPE_TYPES}, not {rope.get('rope_type')!r}")
        return LlamaRotaryEmbedding(
            LlamaConfig(
                hidden_size=cfg.hidden_size,
                num_attention_heads=cfg.num_attention_heads,
                head_dim=cfg.qk_rope_head_dim,
                max_position_embeddings=cfg.max_position_embeddings,
                rope_parameters=rope,
            )
        )

    def input_weight(self) -> torch.Tensor:
        """[q_lora_rank (or h·qk) + kv_lora_rank + rope, 2H]: q's and the latent's projections of the input, which
        the engines fuse in this order (fused_qkv_a_proj)."""
        return torch.cat([getattr(self, name).weight for name in self.INPUT_PROJECTIONS])

    def heads_from_input(self, projected, cos, sin):
        """F.linear(x, input_weight()) [B,T,·] → q, k [B,h,T,qk_head_dim], v [B,h,T,v_head_dim], rope applied."""
        b, t, _ = projected.shape
        q_part, latent = projected.split([projected.shape[-1] - self.kv_lora_rank - self.rope_dim,
                                          self.kv_lora_rank + self.rope_dim], -1)  # fmt: skip
        q = q_part if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(q_part))
        q = q.view(b, t, self.heads, self.qk_head_dim).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], -1)
        c, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(b, t, self.heads, self.nope_dim + self.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope_dim, self.v_head_dim], -1)
        k_pe = rotate_interleaved(k_pe[:, None], cos, sin).expand(b, self.heads, t, self.rope_dim)
        q = torch.cat([q_nope, rotate_interleaved(q_pe, cos, sin)], -1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return q, torch.cat([k_nope, k_pe], -1), v

    def qkv(self, x, cos, sin):
        return self.heads_from_input(F.linear(x, self.input_weight()), cos, sin)

    def output(self, out):
        """o_proj over attention outputs [B,h,T,v_head_dim]."""
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.v_head_dim))

    def attend(self, q, k, v, mask):
        """q, k [B,h,S,qk_head_dim]; v [B,h,S,v_head_dim]; mask bool [B,T,S] (True = may attend)."""
        return self.output(F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None]))
