"""The TTT loss without full-vocabulary logits in memory.

Soft cross-entropy of the draft's lm_head against the target's distribution over the draft
vocabulary, summed over valid positions. Rows go through in chunks: each chunk's logits are
made, used for the loss, the argmax and the gradient, and dropped. The gradients with respect
to the head's input and weight are computed in the forward pass (the loss is a sum, so the
backward only scales them), which saves the second lm_head matmul a recompute would cost.
At 131,072 positions and a 32,000-token draft vocabulary the fp32 logits alone would be
16 GiB per TTT step; here a step holds one chunk of them.

    loss = Σ_rows valid · ( logsumexp(z) · Σp − Σ_v p_v z_v ),   z = h Wᵀ
    ∂loss/∂z = valid · ( softmax(z) · Σp − p )
"""
from __future__ import annotations

import torch

CHUNK_ELEMENTS = 2 ** 26  # rows per chunk × vocab: 256 MiB of fp32 logits


def compute_dtype(device_type: str, default: torch.dtype) -> torch.dtype:
    """The dtype matmuls run in: autocast's when it is on for this device, else default."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else default


def target_probs(final: torch.Tensor, head_draft: torch.Tensor, dtype: torch.dtype,
                 chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """softmax(final · head_draftᵀ) over the draft vocab, [N, V] in dtype, made chunk by chunk."""
    flat = final.reshape(-1, final.shape[-1]).to(head_draft.dtype)
    out = torch.empty(flat.shape[0], head_draft.shape[0], dtype=dtype, device=final.device)
    rows = max(1, chunk_elements // head_draft.shape[0])
    for i in range(0, flat.shape[0], rows):
        out[i:i + rows] = torch.softmax((flat[i:i + rows] @ head_draft.T).float(), -1).to(dtype)
    return out


class LinearSoftCE(torch.autograd.Function):
    """(h [N,H], weight [V,H], probs [N,V], valid [N] bool, offset) → (Σ loss, argmax [N]).

    Row i of h is scored against probs row i + offset (TTT step k reads the target k+1
    positions ahead); rows whose target falls outside are expected to be invalid."""

    @staticmethod
    def forward(ctx, h, weight, probs, valid, offset: int, dtype: torch.dtype, chunk_elements: int):
        n, v = h.shape[0], weight.shape[0]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]   # a frozen lm_head needs no grad_w
        w = weight.to(dtype)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        best = torch.empty(n, dtype=torch.long, device=h.device)
        grad_h = torch.empty(n, h.shape[1], dtype=dtype, device=h.device) if want_h else None
        grad_w = torch.zeros(v, h.shape[1], dtype=torch.float32, device=h.device) if want_w else None
        rows = max(1, chunk_elements // v)
        for a in range(0, n, rows):
            b = min(n, a + rows)
            x = h[a:b].to(dtype)
            z = (x @ w.T).float()
            p = torch.zeros_like(z)
            end = min(probs.shape[0], b + offset)
            if a + offset < end:
                p[:end - a - offset] = probs[a + offset:end].float()
            mask = valid[a:b].to(z.dtype)
            lse = torch.logsumexp(z, -1)
            p_sum = p.sum(-1)
            loss += ((lse * p_sum - (p * z).sum(-1)) * mask).sum()
            best[a:b] = z.argmax(-1)
            if want_h or want_w:
                g = ((torch.exp(z - lse[:, None]) * p_sum[:, None] - p) * mask[:, None]).to(dtype)
                if want_h:
                    grad_h[a:b] = g @ w
                if want_w:
                    grad_w += (g.T @ x).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        ctx.mark_non_differentiable(best)
        return loss, best

    @staticmethod
    def backward(ctx, grad_loss, _grad_best):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        dh = (grad_h.to(h_dtype) * grad_loss.to(h_dtype)) if ctx.needs_input_grad[0] else None
        dw = (grad_w * grad_loss).to(w_dtype) if ctx.needs_input_grad[1] else None
        return dh, dw, None, None, None, None, None


def linear_soft_ce(h: torch.Tensor, weight: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor, offset: int = 0,
                   dtype: torch.dtype | None = None, chunk_elements: int = CHUNK_ELEMENTS):
    """Σ over valid rows of the soft CE of h·weightᵀ against probs shifted by offset, and the
    per-row argmax of the logits. h [..., H] and valid [...] are flattened together."""
    dtype = compute_dtype(h.device.type, h.dtype) if dtype is None else dtype
    flat_h = h.reshape(-1, h.shape[-1])
    loss, best = LinearSoftCE.apply(flat_h, weight, probs, valid.reshape(-1), offset, dtype, chunk_elements)
    return loss, best.view(h.shape[:-1])
