"""The TTT loss without full-vocabulary logits in memory.

Soft cross-entropy of the draft's lm_head against the target's distribution over the draft
vocabulary, summed over valid positions. Rows go through in chunks: each chunk's logits are
made, used for the loss, the argmax and the gradient, and dropped. The gradients with respect
to the head's input and weight are computed in the forward pass (the loss is a sum, so the
backward only scales them), which saves the second lm_head matmul a recompute would cost.
At 131,072 positions and a 32,000-token draft vocabulary the fp32 logits alone would be
16 GiB per TTT step; here a step holds one chunk of them.

On CUDA the per-chunk elementwise work (logsumexp, the loss, the argmax, the gradient of the
logits) is one torch.compile'd kernel that reads the logits and the target once, instead of
about ten eager passes over fp32 copies, and the head's weight gradient accumulates in fp32
straight out of the matmul (addmm with out_dtype).

    loss = Σ_rows valid · ( logsumexp(z) · Σp − Σ_v p_v z_v ),   z = h Wᵀ
    ∂loss/∂z = valid · ( softmax(z) · Σp − p )
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 2**26  # rows per chunk × vocab: 256 MiB of fp32 logits


def compute_dtype(device_type: str, default: torch.dtype) -> torch.dtype:
    """The dtype matmuls run in: autocast's when it is on for this device, else default."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else default


def target_probs(
    final: torch.Tensor, head_draft: torch.Tensor, dtype: torch.dtype, chunk_elements: int = CHUNK_ELEMENTS
) -> torch.Tensor:
    """softmax(final · head_draftᵀ) over the draft vocab, [N, V] in dtype, made chunk by chunk."""
    flat = final.reshape(-1, final.shape[-1]).to(head_draft.dtype)
    out = torch.empty(flat.shape[0], head_draft.shape[0], dtype=dtype, device=final.device)
    rows = max(1, chunk_elements // head_draft.shape[0])
    for i in range(0, flat.shape[0], rows):
        out[i : i + rows] = torch.softmax((flat[i : i + rows] @ head_draft.T).float(), -1).to(dtype)
    return out


def target_top_token(
    final: torch.Tensor, head_draft: torch.Tensor, dtype: torch.dtype, chunk_elements: int = CHUNK_ELEMENTS
) -> torch.Tensor:
    """One-hot of the target's most likely draft-vocab token, [N, V] in dtype: the soft CE against it is the
    cross-entropy on the target's top token (greedy acceptance asks only for that token)."""
    flat = final.reshape(-1, final.shape[-1]).to(head_draft.dtype)
    out = torch.zeros(flat.shape[0], head_draft.shape[0], dtype=dtype, device=final.device)
    rows = max(1, chunk_elements // head_draft.shape[0])
    for i in range(0, flat.shape[0], rows):
        best = (flat[i : i + rows] @ head_draft.T).argmax(-1)
        out[i : i + rows].scatter_(1, best[:, None], 1)
    return out


# train.loss_target: what the drafter's distribution is fitted to at each position
LOSS_TARGETS = {"distribution": target_probs, "top_token": target_top_token}


def soft_ce_chunk(z: torch.Tensor, p: torch.Tensor, mask: torch.Tensor, with_grad: bool = True):
    """Logits z [n,V], target probs p [n,V] and a 0/1 mask [n] → (Σ loss, argmax [n], ∂loss/∂z in z's dtype,
    or None without with_grad). The maths runs in fp32 whatever the inputs' dtype."""
    zf, pf = z.float(), p.float()
    lse = torch.logsumexp(zf, -1)
    p_sum = pf.sum(-1)
    loss = ((lse * p_sum - (pf * zf).sum(-1)) * mask).sum()
    if not with_grad:
        return loss, zf.argmax(-1), None
    grad = ((torch.exp(zf - lse[:, None]) * p_sum[:, None] - pf) * mask[:, None]).to(z.dtype)
    return loss, zf.argmax(-1), grad


_compiled_chunk = None


def chunk_kernel(device: torch.device, fused: bool | None = None):
    """soft_ce_chunk, torch.compile'd (dynamic row count) on CUDA unless fused=False."""
    global _compiled_chunk
    if fused is None:
        fused = device.type == "cuda"
    if not fused:
        return soft_ce_chunk
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(soft_ce_chunk, dynamic=True, fullgraph=True)
    return _compiled_chunk


class LinearSoftCE(torch.autograd.Function):
    """(h [N,H], weight [V,H], probs [N,V], valid [N] bool, offset, ..., rows) → (Σ loss, argmax [N]).

    Row i of h is scored against probs row i + offset (TTT step k reads the target k+1
    positions ahead); rows whose target falls outside are expected to be invalid.
    rows: the indices of the valid rows (int64 [M]), when given only those are scored: the invalid
    rows' logits add nothing to the loss or the gradients, and their argmax is returned as 0."""

    @staticmethod
    def forward(
        ctx,
        h,
        weight,
        probs,
        valid,
        offset: int,
        dtype: torch.dtype,
        chunk_elements: int,
        fused: bool | None = None,
        rows: torch.Tensor | None = None,
    ):
        n, v = h.shape[0], weight.shape[0]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]  # a frozen lm_head needs no grad_w
        w = weight.to(dtype)
        kernel = chunk_kernel(h.device, fused)
        # cuBLAS accumulates bf16/fp16 products into an fp32 output directly; elsewhere, an fp32 copy per chunk
        fp32_out = h.device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        best = torch.empty(n, dtype=torch.long, device=h.device) if rows is None else h.new_zeros(n, dtype=torch.long)
        grad_h = None
        if want_h:
            grad_h = (torch.empty if rows is None else torch.zeros)(n, h.shape[1], dtype=dtype, device=h.device)
        grad_w = torch.zeros(v, h.shape[1], dtype=torch.float32, device=h.device) if want_w else None
        scored = n if rows is None else rows.numel()
        step = max(1, chunk_elements // v)
        for a in range(0, scored, step):
            b = min(scored, a + step)
            if rows is None:
                at = slice(a, b)
                p = probs[min(probs.shape[0], a + offset) : min(probs.shape[0], b + offset)]
                if p.shape[0] < b - a:  # rows whose target lies past the end: zero probability (and invalid)
                    p = F.pad(p, (0, 0, 0, b - a - p.shape[0]))
                mask = valid[a:b].float()
            else:
                at = rows[a:b]
                p, mask = probs[at + offset], h.new_ones(b - a, dtype=torch.float32)
            x = h[at].to(dtype)
            chunk_loss, best[at], g = kernel(x @ w.T, p, mask, want_h or want_w)
            loss += chunk_loss
            if want_h:
                grad_h[at] = g @ w
            if want_w:
                if fp32_out:
                    torch.addmm(grad_w, g.T, x, out_dtype=torch.float32, out=grad_w)
                else:
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
        return dh, dw, None, None, None, None, None, None, None


def linear_soft_ce(
    h: torch.Tensor,
    weight: torch.Tensor,
    probs: torch.Tensor,
    valid: torch.Tensor,
    offset: int = 0,
    dtype: torch.dtype | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
    fused: bool | None = None,
    only_valid: bool = False,
    rows: torch.Tensor | None = None,
):
    """Σ over valid rows of the soft CE of h·weightᵀ against probs shifted by offset, and the
    per-row argmax of the logits. h [..., H] and valid [...] are flattened together.
    fused: compile the per-chunk kernel (default: on CUDA).
    only_valid: score the valid rows only (the same loss and gradients for less work where many rows are
    invalid, e.g. user turns; the argmax of an invalid row is then 0). It reads the valid count on the host, unless
    rows gives the valid rows' flat indices (made on the host: the step does not wait for the GPU)."""
    dtype = compute_dtype(h.device.type, h.dtype) if dtype is None else dtype
    flat_h, flat_valid = h.reshape(-1, h.shape[-1]), valid.reshape(-1)
    if only_valid and rows is None:
        rows = flat_valid.nonzero().flatten()
    elif not only_valid:
        rows = None
    loss, best = LinearSoftCE.apply(flat_h, weight, probs, flat_valid, offset, dtype, chunk_elements, fused, rows)
    return loss, best.view(h.shape[:-1])
