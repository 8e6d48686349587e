"""The EAGLE-3 draft model, shaped as SGLang's and vLLM's `llama_eagle3.py` serve it.

    fc:      Linear(3·H_target → H) over the concatenated aux states of the target
    layer:   one Llama decoder layer whose attention reads concat(input_layernorm(embed), hidden_norm(h)),
             i.e. q/k/v take 2H, with the residual taken from h
    norm:    final RMSNorm; logits = lm_head(norm(h)) over the draft vocabulary
    output:  the pre-norm hidden state, which the next draft step takes as its h

Token embeddings are the target's (frozen, not part of the checkpoint); d2t maps
draft ids to target ids (target = draft + d2t[draft]); t2d marks target ids in
the draft vocabulary.

Two ways to run it, which must agree (tests/test_drafter.py):
- `ttt_forward`: training-time test, all K chain steps for every position at
  once; step k's query at position t+k attends to step-0 keys at positions ≤ t
  (same document) and to the keys of steps 1..k at the same t.
- `DraftCache` + `step`: the chain as engines run it, one token at a time with
  a KV cache, feeding the draft its own hidden states.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass
class DrafterConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int                 # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]        # HF hidden_states indexing (DESIGN.md §4)
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, aux_layer_ids: list[int]) -> "DrafterConfig":
        """Dims default to the target's, as the engines expect."""
        c = getattr(target_config, "text_config", None) or target_config
        heads = c.num_attention_heads
        rope = getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(c, "rope_theta", 10000.0)}
        return cls(hidden_size=c.hidden_size, num_attention_heads=heads,
                   num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                   intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
                   draft_vocab_size=draft_vocab_size, target_hidden_size=c.hidden_size,
                   aux_layer_ids=list(aux_layer_ids), rms_norm_eps=c.rms_norm_eps,
                   hidden_act=getattr(c, "hidden_act", "silu"),
                   max_position_embeddings=getattr(c, "max_position_embeddings", 8192), rope_parameters=dict(rope))

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           intermediate_size=self.intermediate_size, vocab_size=self.vocab_size,
                           rms_norm_eps=self.rms_norm_eps, hidden_act=self.hidden_act, num_hidden_layers=1,
                           max_position_embeddings=self.max_position_embeddings,
                           rope_parameters=dict(self.rope_parameters), tie_word_embeddings=False)

    def to_hf_dict(self) -> dict:
        """config.json of the canonical checkpoint: flat Llama fields plus the EAGLE-3 ones."""
        d = self.llama_config().to_dict()
        d.update(architectures=[ARCHITECTURE], model_type="llama", draft_vocab_size=self.draft_vocab_size,
                 target_hidden_size=self.target_hidden_size, num_hidden_layers=1, tie_word_embeddings=False,
                 eagle_config={"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                               "aux_layer_id_convention": "hf_hidden_states"})
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> "DrafterConfig":
        rope = d.get("rope_parameters") or {"rope_type": "default", "rope_theta": d.get("rope_theta", 10000.0),
                                            **(d.get("rope_scaling") or {})}
        heads = d["num_attention_heads"]
        return cls(hidden_size=d["hidden_size"], num_attention_heads=heads,
                   num_key_value_heads=d.get("num_key_value_heads") or heads,
                   head_dim=d.get("head_dim") or d["hidden_size"] // heads, intermediate_size=d["intermediate_size"],
                   vocab_size=d["vocab_size"], draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
                   target_hidden_size=d.get("target_hidden_size") or d["hidden_size"],
                   aux_layer_ids=list(d["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
                   rms_norm_eps=d["rms_norm_eps"], hidden_act=d.get("hidden_act", "silu"),
                   max_position_embeddings=d.get("max_position_embeddings", 8192), rope_parameters=rope)

    def as_dict(self) -> dict:
        return asdict(self)


class Attention(nn.Module):
    """Llama attention over a 2H input; the caller supplies keys/values to attend to and the mask."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def attend(self, q, k, v, mask):
        """q [B,h,T,d]; k, v [B,kv,S,d]; mask bool [B,T,S] (True = may attend)."""
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=self.heads != self.kv_heads)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        llama = cfg.llama_config()
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(llama)

    def attn_input(self, embeds, hidden):
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, attn_out, hidden):
        """Residual from h, then post-attention norm and MLP; returns the pre-norm output state."""
        h = hidden + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg)])
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(cfg.llama_config())

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

    def rope(self, x, position_ids):
        return self.rotary(x, position_ids)

    # ---------------------------------------------------------- training ----
    def ttt_forward(self, aux, step_embeds, position_ids, doc_ids, attention: str = "auto", checkpoint: bool = False):
        """Training-time test over K = len(step_embeds) chain steps.

        aux [B,T,3H_t]: target aux states at each position t.
        step_embeds[k] [B,T,H]: embedding of the token fed at step k for position t
            (the ground-truth token t+1+k).
        position_ids [B,T]: positions within each document; doc_ids [B,T]: document
            of each position in a packed row (-1 = padding).
        Returns the pre-norm hidden states of each step, [B,T,H] each.

        Step k's query at t attends to the step-0 keys at s ≤ t (same document) and to
        the step-1..k keys at t itself. attention="dense" scores those diagonals as dot
        products beside one T×T block (simple; memory grows with T², fine on the CPU);
        "flex" runs flex_attention with a block mask, which never materializes T×T
        scores (long sequences on GPUs). "auto": flex on CUDA, dense elsewhere.
        checkpoint (flex only): keep each step's inputs and recompute the step in the
        backward pass instead of holding its activations (MLP, norms) for all K steps.
        """
        if attention == "auto":
            attention = "flex" if aux.is_cuda else "dense"
        if attention == "flex":
            return self._ttt_forward_flex(aux, step_embeds, position_ids, doc_ids, checkpoint)
        attn, layer = self.layer.self_attn, self.layer
        t = aux.shape[1]
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=aux.device))
        same_doc = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (doc_ids[:, :, None] >= 0)
        eye = torch.eye(t, dtype=torch.bool, device=aux.device)
        prefix_mask = ((causal & same_doc) | eye)[:, None]                # [B,1,T,T]; padding sees itself
        groups = attn.heads // attn.kv_heads
        hidden = self.fc(aux)
        prefix_k = prefix_v = None
        diag_k, diag_v, outputs = [], [], []
        for k, embeds in enumerate(step_embeds):
            cos, sin = self.rope(hidden, position_ids + k)
            q, key, value = attn.qkv(layer.attn_input(embeds, hidden), cos, sin)
            key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
            if k == 0:
                prefix_k, prefix_v = key, value
            else:
                diag_k.append(key)
                diag_v.append(value)
            scale = attn.head_dim ** -0.5
            scores = (q @ prefix_k.transpose(-1, -2)) * scale                # [B,h,T,T]
            scores = scores.masked_fill(~prefix_mask, float("-inf"))
            diag = [(q * dk).sum(-1, keepdim=True) * scale for dk in diag_k]  # [B,h,T,1] each
            probs = torch.softmax(torch.cat([scores] + diag, -1), -1)
            out = probs[..., :t] @ prefix_v
            for j, dv in enumerate(diag_v):
                out = out + probs[..., t + j:t + j + 1] * dv
            b = out.shape[0]
            attn_out = attn.o_proj(out.transpose(1, 2).reshape(b, t, attn.heads * attn.head_dim))
            hidden = layer.finish(attn_out, hidden)
            outputs.append(hidden)
        return outputs

    def _ttt_forward_flex(self, aux, step_embeds, position_ids, doc_ids, checkpoint: bool = False):
        attn, layer = self.layer.self_attn, self.layer
        b, t = aux.shape[:2]
        # Each step's keys sit in a region of t_pad (a whole number of blocks) so that a
        # region starts on a block boundary and the block mask can be built per block.
        t_pad = -(-t // TTT_BLOCK) * TTT_BLOCK
        docs = F.pad(doc_ids, (0, t_pad - t), value=-1)
        masks = ttt_block_masks(docs, t, len(step_embeds))

        def one_step(embeds, hidden, pos, mask, *cached):
            cos, sin = self.rope(hidden, pos)
            q, key, value = attn.qkv(layer.attn_input(embeds, hidden), cos, sin)
            key, value = (F.pad(x, (0, 0, 0, t_pad - t)) for x in (key, value))
            keys, values = cached[:len(cached) // 2] + (key,), cached[len(cached) // 2:] + (value,)
            out = _flex_attention(q, torch.cat(keys, 2), torch.cat(values, 2), block_mask=mask,
                                  enable_gqa=attn.heads != attn.kv_heads)
            attn_out = attn.o_proj(out.transpose(1, 2).reshape(b, t, attn.heads * attn.head_dim))
            return layer.finish(attn_out, hidden), key, value

        hidden = self.fc(aux)
        keys, values, outputs = [], [], []
        for k, embeds in enumerate(step_embeds):
            args = (embeds, hidden, position_ids + k, masks[k], *keys, *values)
            if checkpoint:
                hidden, key, value = torch.utils.checkpoint.checkpoint(one_step, *args, use_reentrant=False)
            else:
                hidden, key, value = one_step(*args)
            keys.append(key)
            values.append(value)
            outputs.append(hidden)
        return outputs

    # --------------------------------------------------------- inference ----
    def step(self, cache: "DraftCache", embeds, hidden, position_ids, from_target: bool):
        """Append n entries (embeds [B,n,H], positions [B,n]) to the cache, attending causally to
        everything cached. hidden is the target's concatenated aux states [B,n,3H_t] when
        from_target (the first step after verification), else the draft's own output [B,n,H].
        Returns (pre-norm output hidden [B,n,H], logits [B,n,V_draft])."""
        if from_target:
            hidden = self.fc(hidden)
        attn, layer = self.layer.self_attn, self.layer
        cos, sin = self.rope(hidden, position_ids)
        q, key, value = attn.qkv(layer.attn_input(embeds, hidden), cos, sin)
        cache.append(key, value, position_ids)
        mask = cache.positions[:, None, :] <= position_ids[:, :, None]
        out = layer.finish(attn.attend(q, cache.keys, cache.values, mask), hidden)
        return out, self.logits(out)


TTT_BLOCK = 128  # flex_attention's block size


def ttt_block_masks(docs: torch.Tensor, t: int, steps: int) -> list:
    """flex_attention block masks of TTT steps 0..steps-1, built from per-block facts in
    O((T/128)²) instead of evaluating every (query, key) pair (86 G pairs at T = 131,072, K = 5).

    docs [B, t_pad]: document id per position, -1 for padding (and for positions ≥ t).
    Step k's keys are k+1 regions of t_pad: region 0 holds step 0's keys (causal, same
    document; a padding query sees itself), region r ≥ 1 holds step r's keys, of which
    query t sees only position t.
    """
    from torch.nn.attention.flex_attention import BlockMask
    bsz, t_pad = docs.shape
    n = t_pad // TTT_BLOCK
    blocks = docs.view(bsz, n, TTT_BLOCK)
    real = blocks >= 0
    big = torch.iinfo(docs.dtype).max
    lo = torch.where(real, blocks, big).amin(-1)                      # [B, n] smallest document in a block
    hi = torch.where(real, blocks, -1).amax(-1)                       # largest (-1: no real position)
    q_idx = torch.arange(n, device=docs.device)
    below = q_idx[None, :] < q_idx[:, None]                           # [q, kv]: kv block strictly before q block
    diagonal = torch.eye(n, dtype=torch.bool, device=docs.device)
    overlap = (hi[:, None, :] >= lo[:, :, None]) & (lo[:, None, :] <= hi[:, :, None])     # [B, q, kv]
    one_doc = (lo == hi) & real.all(-1)
    full0 = below & one_doc[:, :, None] & one_doc[:, None, :] & (lo[:, :, None] == lo[:, None, :])
    partial0 = ((below & overlap) | diagonal) & ~full0
    docs_flat = docs

    def mask_mod(b, h, q, kv):
        region, pos = kv // t_pad, kv % t_pad
        same_doc = (docs_flat[b, q] == docs_flat[b, pos]) & (docs_flat[b, q] >= 0)
        return torch.where(region == 0, ((pos <= q) & same_doc) | (pos == q), pos == q)

    def as_indices(nonempty):                                         # [B, q, kv] bool → counts, indices
        counts = nonempty.sum(-1, dtype=torch.int32)
        order = torch.argsort((~nonempty).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts[:, None], order[:, None]

    masks = []
    for k in range(steps):
        partial = torch.cat([partial0] + [diagonal.expand(bsz, n, n)] * k, -1)
        full = torch.cat([full0] + [torch.zeros_like(full0)] * k, -1)
        kv_num, kv_idx = as_indices(partial)
        full_num, full_idx = as_indices(full)
        masks.append(BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=TTT_BLOCK,
                                              mask_mod=mask_mod, seq_lengths=(t, t_pad * (k + 1))))
    return masks


def _flex_attention(q, k, v, **kw):
    """flex_attention, compiled on GPUs (its fused kernel); eager elsewhere (tests, CPU)."""
    from torch.nn.attention.flex_attention import flex_attention
    global _compiled_flex
    if not q.is_cuda:
        return flex_attention(q, k, v, **kw)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex(q, k, v, **kw)


_compiled_flex = None


class DraftCache:
    """The draft's KV cache for one chain, as an engine keeps it."""

    def __init__(self):
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None
        self.positions: Optional[torch.Tensor] = None

    def append(self, key, value, positions):
        if self.keys is None:
            self.keys, self.values, self.positions = key, value, positions
        else:
            self.keys = torch.cat([self.keys, key], 2)
            self.values = torch.cat([self.values, value], 2)
            self.positions = torch.cat([self.positions, positions], 1)
