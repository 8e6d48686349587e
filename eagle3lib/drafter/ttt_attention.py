"""Training-time-test attention: step k's query at t attends to step 0's keys at s ≤ t of its document
and to the keys of steps 1..k at t itself (Drafter.ttt_forward). Three ways to compute it, which agree
(tests/unit/test_drafter.py):

- dense: one T×T block of scores plus the diagonals, in one softmax (the reference; CPU);
- flex: flex_attention with per-block masks, which never materializes T×T scores;
- merged: a stock fused causal kernel with its log-sum-exp, merged with the diagonals by log-sum-exp.
  Rows of one document run cuDNN's causal kernel; packed rows run flash attention's variable-length
  causal kernel over each row's documents (and padding runs) as separate sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def one_document_rows(doc_ids: torch.Tensor) -> bool:
    """Every row holds one document followed only by padding (-1): step 0's attention is then
    plain causal attention, and the real positions never see the padding after them."""
    real = doc_ids >= 0
    prefix = real.cummin(1).values == real  # no real position after padding
    same = (doc_ids == doc_ids[:, :1]) | ~real
    return bool((prefix & same).all() and real[:, 0].all())


def dense_prefix_mask(doc_ids):
    """[B,1,T,T] step-0 mask: causal within the document; a padding position sees itself."""
    t = doc_ids.shape[1]
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=doc_ids.device))
    same_doc = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (doc_ids[:, :, None] >= 0)
    eye = torch.eye(t, dtype=torch.bool, device=doc_ids.device)
    return ((causal & same_doc) | eye)[:, None]


def dense_ttt_attention(q, keys, values, prefix_mask):
    """q [B,h,T,d]; keys/values of steps 0..k with h heads. Scores over step 0's keys under the
    mask, and one dot product per later step's key at the query's own position, in one softmax."""
    t = q.shape[2]
    scale = q.shape[-1] ** -0.5
    scores = ((q @ keys[0].transpose(-1, -2)) * scale).masked_fill(~prefix_mask, float("-inf"))
    diag = [(q * dk).sum(-1, keepdim=True) * scale for dk in keys[1:]]  # [B,h,T,1] each
    probs = torch.softmax(torch.cat([scores] + diag, -1), -1)
    out = probs[..., :t] @ values[0]
    for j, dv in enumerate(values[1:]):
        out = out + probs[..., t + j : t + j + 1] * dv
    return out


# ----------------------------------------------- causal ⊕ diagonal attention ----
# Step k of TTT attends causally to step 0's keys of its document, plus one key of each step 1..k at
# the query's own position. The causal part is a stock fused kernel that also returns its log-sum-exp;
# the k diagonal scores merge in by log-sum-exp, as ring attention merges blocks. Backward: the fused
# kernel's backward, given the *merged* output and log-sum-exp, returns exactly the causal part's share
# of the gradients (its softmax is recomputed as exp(s - lse_merged) and its row term as dO·O_merged);
# the diagonal parts are elementwise. The diagonals need no document mask: each is the query's own
# position. Kernels: rows of one document, cuDNN's causal kernel (q's heads for the keys); packed rows,
# flash attention's variable-length causal kernel with each document (and each padding run) of the
# flattened B·T tokens as one sequence (GQA native: the keys keep their kv heads).


HALF_DTYPES = (torch.float16, torch.bfloat16)


def auto_attention(is_cuda: bool, half_precision: bool) -> str:
    """ttt_forward's attention="auto": on CUDA in fp16/bf16 the merged path (cuDNN's causal kernel for rows of
    one document, flash attention's variable-length kernel for packed rows); flex_attention for fp32 (cuDNN takes
    no fp32: its raw op returns wrong scores for fp32 inputs instead of failing; flash refuses it); the dense
    reference elsewhere."""
    if not is_cuda:
        return "dense"
    return "merged" if half_precision else "flex"


@dataclass(frozen=True)
class PackedSegments:
    """The runs of one document, or of padding, in rows [B,T], as offsets into the flattened B·T tokens."""

    cu_seqlens: torch.Tensor  # int32 [S+1]: run s covers tokens cu_seqlens[s]..cu_seqlens[s+1]-1
    max_len: int  # the longest run
    segment_ids: torch.Tensor  # [B,T] run index of each position (the CPU reference's mask)

    def to(self, device) -> PackedSegments:
        move = lambda x: x.to(device, non_blocking=True)  # noqa: E731
        return PackedSegments(move(self.cu_seqlens), self.max_len, move(self.segment_ids))


@dataclass(frozen=True)
class RowLayout:
    """What the attention reads of rows' documents on the host (a GPU would wait for it): whether every row holds
    one document (cuDNN's kernel) and the runs of documents (flash varlen's)."""

    one_document: bool
    segments: PackedSegments

    def to(self, device) -> RowLayout:
        return RowLayout(self.one_document, self.segments.to(device))


def row_layout(doc_ids: torch.Tensor) -> RowLayout:
    """doc_ids [B,T]'s layout; computed from the host copy of a batch before it moves, the step never syncs."""
    return RowLayout(one_document_rows(doc_ids), packed_segments(doc_ids))


def packed_segments(doc_ids: torch.Tensor) -> PackedSegments:
    """doc_ids [B,T] (-1 = padding) → its runs: a run starts at each row's start and where the id changes."""
    b, t = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    flat = starts.flatten()
    cu = torch.cat([flat.nonzero().flatten(), torch.tensor([b * t], device=doc_ids.device)]).to(torch.int32)
    return PackedSegments(cu, int((cu[1:] - cu[:-1]).max()), (flat.cumsum(0) - 1).view(b, t))


def _causal_forward(q, k, v, scale, segments: PackedSegments | None):
    """(out [B,h,T,d], lse [B,h,T,1] fp32, state for the backward) of causal attention; k, v [B,kv,T,d]
    (kv = h for cuDNN), within each segment when segments are given."""
    if q.is_cuda:
        if q.dtype not in HALF_DTYPES:  # cuDNN's raw op does not check: fp32 gives wrong scores silently
            raise ValueError(f"the fused causal kernels take fp16/bf16, not {q.dtype}")
        if segments is not None:
            return _flash_varlen_forward(q, k, v, scale, segments)
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
        return r[0], r[1], r[2:8]
    s = _causal_scores(q, k, scale, segments)  # the reference, for the CPU and tests
    lse = torch.logsumexp(s, -1, keepdim=True)
    return (torch.exp(s - lse) @ _broadcast_kv(v, q).float()).to(q.dtype), lse, None


def _causal_backward(dout, q, k, v, out, lse, scale, state, segments: PackedSegments | None):
    """dq, dk, dv of causal attention, with the softmax taken as exp(s - lse) and the row term as dO·out."""
    if q.is_cuda:
        if segments is not None:
            return _flash_varlen_backward(dout, q, k, v, out, lse, scale, state, segments)
        cum_q, cum_k, max_q, max_k, seed, offset = state
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True, scale=scale
        )
    df = dout.float()
    p = torch.exp(_causal_scores(q, k, scale, segments) - lse)  # 0 where masked
    kf, vf = _broadcast_kv(k, q).float(), _broadcast_kv(v, q).float()
    ds = p * (df @ vf.transpose(-1, -2) - (df * out.float()).sum(-1, keepdim=True))
    dq, dk = ds @ kf * scale, ds.transpose(-1, -2) @ q.float() * scale
    return dq.to(q.dtype), _sum_groups(dk, k), _sum_groups(p.transpose(-1, -2) @ df, v)


def _tokens_major(x):
    """[B,n,T,d] → [B·T,n,d], the varlen kernels' layout (a view when x is laid out token-major)."""
    b, n, t, d = x.shape
    return x.transpose(1, 2).reshape(b * t, n, d)


def _flash_varlen_forward(q, k, v, scale, seg: PackedSegments):
    b, h, t, d = q.shape
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        _tokens_major(q), _tokens_major(k), _tokens_major(v), seg.cu_seqlens, seg.cu_seqlens,
        seg.max_len, seg.max_len, 0.0, True, False, scale=scale,
    )  # fmt: skip
    if lse.shape != (h, b * t):
        raise RuntimeError(f"flash varlen returned a log-sum-exp of shape {tuple(lse.shape)}, expected ({h}, {b * t})")
    # Views in [B,h,T,·] order over the kernel's token-major memory: the merge reads them as they are.
    return out.view(b, t, h, d).transpose(1, 2), lse.view(h, b, t).transpose(0, 1)[..., None], (rng, unused)


def _flash_varlen_backward(dout, q, k, v, out, lse, scale, state, seg: PackedSegments):
    b, h, t, d = q.shape
    lse_flat = lse[..., 0].transpose(0, 1).reshape(h, b * t).contiguous()
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        _tokens_major(dout), _tokens_major(q), _tokens_major(k), _tokens_major(v), _tokens_major(out), lse_flat,
        seg.cu_seqlens, seg.cu_seqlens, seg.max_len, seg.max_len, 0.0, True, *state, scale=scale,
    )  # fmt: skip
    heads_major = lambda x: x.view(b, t, -1, d).transpose(1, 2)  # noqa: E731
    return heads_major(dq), heads_major(dk), heads_major(dv)


def _causal_scores(q, k, scale, segments: PackedSegments | None = None):
    """fp32 scores q·k·scale, -inf above the diagonal and across segments (the CPU reference kernel pair)."""
    s = (q.float() @ _broadcast_kv(k, q).float().transpose(-1, -2)) * scale
    keep = torch.ones_like(s, dtype=torch.bool).tril()
    if segments is not None:
        ids = segments.segment_ids
        keep = keep & (ids[:, None, :, None] == ids[:, None, None, :])
    return s.masked_fill(~keep, float("-inf"))


def _diagonal_score(qg, dk, scale):
    """q·k at each query's own position: qg [B,kv,h/kv,T,d] against one step's keys dk [B,kv,T,d] → [B,h,T,1] fp32."""
    return (qg.float() * dk.float()[:, :, None]).sum(-1, keepdim=True).flatten(1, 2) * scale


def _merge_diagonals(q, out_c, lse, scale, *diag):
    """The causal part's output and log-sum-exp merged with steps 1..k's diagonal keys (diag = keys
    then values, [B,kv,T,d]) → (out [B,h,T,d] in out_c's dtype, merged log-sum-exp [B,h,T,1] fp32)."""
    n = len(diag) // 2
    qg = _by_kv_group(q, diag[0])
    scores = [_diagonal_score(qg, dk, scale) for dk in diag[:n]]
    merged = torch.logsumexp(torch.cat([lse] + scores, -1), -1, keepdim=True)
    acc = torch.exp(lse - merged) * out_c.float()
    for s, dv in zip(scores, diag[n:]):
        acc = acc + torch.exp(s - merged) * _broadcast_kv(dv, q)
    return acc.to(out_c.dtype), merged


def _diagonal_grads(grad, out, merged, q, dq_causal, scale, *diag):
    """The diagonal keys' share of the gradients: dq (the causal part's dq_causal added), then dk and
    dv of each diagonal step. Elementwise: each query meets one key of each step."""
    n = len(diag) // 2
    gf, qg = grad.float(), _by_kv_group(q, diag[0]).float()
    row = (gf * out.float()).sum(-1, keepdim=True)  # dO·O, as the fused backward takes it
    dq = dq_causal.float()
    dks, dvs = [], []
    for dk, dv in zip(diag[:n], diag[n:]):
        p = torch.exp(_diagonal_score(qg, dk, scale) - merged)  # [B,h,T,1]
        ds = p * ((gf * _broadcast_kv(dv, q).float()).sum(-1, keepdim=True) - row)
        dq = dq + ds * _broadcast_kv(dk, q).float() * scale
        dks.append(_sum_groups(ds * qg.flatten(1, 2) * scale, dk))
        dvs.append(_sum_groups(p * gf, dv))
    return (dq.to(q.dtype), *dks, *dvs)


_compiled_merge = None


def merge_kernels(compiled: bool):
    """(_merge_diagonals, _diagonal_grads), torch.compile'd when compiled: each becomes a kernel or two
    instead of ~10 eager fp32 passes per diagonal over [B,h,T,d] (on the H200, cuDNN's causal kernel saved
    19 ms a step over flex but the merged step only 2.4 ms; these passes are the likeliest cause, unprofiled).
    dynamic: the row length changes from batch to batch."""
    global _compiled_merge
    if not compiled:
        return _merge_diagonals, _diagonal_grads
    if _compiled_merge is None:
        _compiled_merge = (
            torch.compile(_merge_diagonals, dynamic=True, fullgraph=True),
            torch.compile(_diagonal_grads, dynamic=True, fullgraph=True),
        )
    return _compiled_merge


class _CausalWithDiagonals(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k0, v0, compiled, segments, *diag):
        """q [B,h,T,d]; k0, v0 [B,h,T,d], or [B,kv,T,d] with segments; diag = keys then values of steps 1..k,
        [B,kv,T,d] (GQA: broadcast)."""
        scale = q.shape[-1] ** -0.5
        out_c, lse, state = _causal_forward(q, k0, v0, scale, segments)
        out, merged = out_c, lse  # step 0: no diagonals, the causal part is all
        if diag:
            merge, _ = merge_kernels(compiled)
            acc, merged = merge(q, out_c, lse, scale, *diag)
            out = torch.empty_like(out_c)  # the fused kernel's layout, which its backward expects of out and dO
            out.copy_(acc)
        ctx.save_for_backward(q, k0, v0, out, merged, *diag)
        ctx.state, ctx.scale, ctx.compiled, ctx.segments = state, scale, compiled, segments
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k0, v0, out, merged, *diag = ctx.saved_tensors
        grad = torch.empty_like(out)
        grad.copy_(dout)
        dq, dk0, dv0 = _causal_backward(grad, q, k0, v0, out, merged, ctx.scale, ctx.state, ctx.segments)
        if diag:
            _, diagonal_grads = merge_kernels(ctx.compiled)
            dq, *d_diag = diagonal_grads(grad, out, merged, q, dq, ctx.scale, *diag)
        else:
            d_diag = []
        return (dq, dk0, dv0, None, None, *d_diag)


def _by_kv_group(q, kv):
    """q [B,h,T,d] as [B,kv,h/kv,T,d]: the heads that share each key/value head (repeat_interleave order)."""
    b, h, t, d = q.shape
    return q.view(b, kv.shape[1], h // kv.shape[1], t, d)


def _broadcast_kv(x, q):
    """[B,kv,T,d] → [B,h,T,d] view-expanded to q's heads."""
    b, kvh, t, d = x.shape
    return x[:, :, None].expand(b, kvh, q.shape[1] // kvh, t, d).flatten(1, 2)


def _sum_groups(x, like):
    """[B,h,T,d] gradients → [B,kv,T,d], summing the heads that share a key/value head."""
    b, kvh, t, d = like.shape
    return x.view(b, kvh, -1, t, d).sum(2).to(like.dtype)


def causal_attention_with_diagonals(
    q, k0, v0, diag_keys, diag_values, compiled: bool = False, segments: PackedSegments | None = None
):
    """Step k's TTT attention: q [B,h,T,d]; step 0's keys k0, v0 with q's heads on rows of one document
    (segments None), or with their kv heads [B,kv,T,d] and the rows' documents as segments (packed_segments);
    diag_keys/values: steps 1..k, [B,kv,T,d]. Returns [B,h,T,d].
    Values may be narrower than q and k (MLA: 128 against 192), d_v: then the output is [B,h,T,d_v].
    compiled: the merge torch.compile'd (merge_kernels)."""
    d, d_v = q.shape[-1], v0.shape[-1]
    if d_v == d:
        return _CausalWithDiagonals.apply(q, k0, v0, compiled, segments, *diag_keys, *diag_values)
    if d_v > d:
        raise ValueError(f"the merged attention takes values no wider than q and k: {d_v} against {d}")
    # The fused kernels take one head dim for q, k and v (flash attention 2 refuses others). Values padded with
    # zeros to q's width add zero columns to the output, which are cut off; autograd slices their gradients.
    pad = lambda x: torch.nn.functional.pad(x, (0, d - d_v))  # noqa: E731
    padded = _CausalWithDiagonals.apply(q, k0, pad(v0), compiled, segments, *diag_keys, *map(pad, diag_values))
    return padded[..., :d_v]


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
    lo = torch.where(real, blocks, big).amin(-1)  # [B, n] smallest document in a block
    hi = torch.where(real, blocks, -1).amax(-1)  # largest (-1: no real position)
    q_idx = torch.arange(n, device=docs.device)
    below = q_idx[None, :] < q_idx[:, None]  # [q, kv]: kv block strictly before q block
    diagonal = torch.eye(n, dtype=torch.bool, device=docs.device)
    overlap = (hi[:, None, :] >= lo[:, :, None]) & (lo[:, None, :] <= hi[:, :, None])  # [B, q, kv]
    one_doc = (lo == hi) & real.all(-1)
    full0 = below & one_doc[:, :, None] & one_doc[:, None, :] & (lo[:, :, None] == lo[:, None, :])
    partial0 = ((below & overlap) | diagonal) & ~full0
    docs_flat = docs

    def mask_mod(b, h, q, kv):
        region, pos = kv // t_pad, kv % t_pad
        same_doc = (docs_flat[b, q] == docs_flat[b, pos]) & (docs_flat[b, q] >= 0)
        return torch.where(region == 0, ((pos <= q) & same_doc) | (pos == q), pos == q)

    def as_indices(nonempty):  # [B, q, kv] bool → counts, indices
        counts = nonempty.sum(-1, dtype=torch.int32)
        order = torch.argsort((~nonempty).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts[:, None], order[:, None]

    masks = []
    for k in range(steps):
        partial = torch.cat([partial0] + [diagonal.expand(bsz, n, n)] * k, -1)
        full = torch.cat([full0] + [torch.zeros_like(full0)] * k, -1)
        kv_num, kv_idx = as_indices(partial)
        full_num, full_idx = as_indices(full)
        masks.append(
            BlockMask.from_kv_blocks(
                kv_num,
                kv_idx,
                full_num,
                full_idx,
                BLOCK_SIZE=TTT_BLOCK,
                mask_mod=mask_mod,
                seq_lengths=(t, t_pad * (k + 1)),
            )
        )
    return masks


# flex's default tiles for fp32 heads wider than 128 (an MLA drafter's 192-wide q/k) ask more shared memory than an
# H200 has (279,808 bytes of 232,448): smaller tiles, one stage, forward and backward
WIDE_FP32_TILES = {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1, "BLOCK_M1": 16, "BLOCK_N1": 32, "BLOCK_M2": 32,
                   "BLOCK_N2": 16}  # fmt: skip


def flex_attention_on_device(q, k, v, **kw):
    """flex_attention, compiled on GPUs (its fused kernel); eager elsewhere (tests, CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if not q.is_cuda:
        return flex_attention(q, k, v, **kw)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    tiles = flex_tiles(q.dtype, max(q.shape[-1], v.shape[-1]))
    if tiles:
        kw.setdefault("kernel_options", tiles)
    return _compiled_flex(q, k, v, **kw)


def flex_tiles(dtype: torch.dtype, head_dim: int) -> dict | None:
    """flex_attention's kernel_options for heads of this dtype and width on a GPU; None: its defaults."""
    return WIDE_FP32_TILES if dtype == torch.float32 and head_dim > 128 else None


_compiled_flex = None
