"""The draft layer's attention modules: Llama's (gqa) here, DeepSeek's multi-head latent attention (mla) in mla.py;
ATTENTIONS names both for DrafterConfig.draft_attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from eagle3lib.drafter.mla import MLAAttention


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q, k, cos, sin):
    """Llama's rotary embedding on q, k [B,heads,T,d] with cos, sin [B,T,d]: transformers' apply_rotary_pos_emb,
    written here because that one dispatches through a variable that `kernels` makes process-wide once anything
    compiles, which the hf capture's thread sets mid-forward while the trainer compiles (train.source online)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Attention(nn.Module):
    """Llama attention over a 2H input; the caller supplies keys/values to attend to and the mask. cfg: the drafter's
    DrafterConfig (drafter/config.py, which imports this module for ATTENTIONS)."""

    TARGET_LAYER = "a Llama-shaped target layer"  # what init_from_target_layer maps

    def __init__(self, cfg):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    @staticmethod
    def rotary_embedding(cfg) -> nn.Module:
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
