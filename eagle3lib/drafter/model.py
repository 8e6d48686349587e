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

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from eagle3lib.drafter.config import DrafterConfig
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
        attn, layer = self.layer.self_attn, self.layer
        keep, attend = self.ttt_attention(attention, aux, doc_ids, layout, steps)
        w_embed, w_hidden = layer.qkv_weight_halves()
        embed_qkv = layer.embed_qkv(embeds, w_embed)  # [B,T+K-1,(h+2kv)·d], once

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

    def ttt_attention(self, attention: str, aux, doc_ids, layout: RowLayout | None, steps: int):
        """ttt_forward's attention, chosen ("auto" resolved, see ttt_forward) and set up once: (keep, attend), where
        keep(k, x) lays step k's keys or values out as the kernel takes them and attend(k, q, keys, values) runs step
        k's query against step 0's keys and those of steps 1..k."""
        t = aux.shape[1]
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
        attn = self.layer.self_attn
        groups = attn.heads // attn.kv_heads
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

        return keep, attend

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
