"""Draft vocabulary: the target tokens the drafter can propose.

The `draft_vocab_size` most frequent target tokens among the tokens the drafter
learns to predict (loss-masked positions), sorted by target id so that
d2t[i] = target_id(i) - i is non-negative; t2d marks them over the target vocab.
"""

from __future__ import annotations

import hashlib

import torch


def token_counts(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    ids = input_ids[loss_mask.bool()].long()
    return torch.bincount(ids, minlength=vocab_size)[:vocab_size]


def build_draft_vocab(
    counts: torch.Tensor, draft_vocab_size: int, fallback_counts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [draft_vocab_size], t2d bool [vocab]) from token counts over the target vocab.

    Tokens are ranked by `counts`; ties, and the slots left when the data has fewer
    distinct tokens than the draft vocab, go by `fallback_counts` (e.g. counts over
    all tokens, prompts included), then to the lower target id: deterministic.
    """
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab_size} (the target vocab), got {draft_vocab_size}")
    order = torch.arange(vocab_size)
    # Stable sorts, least significant key first: lower id, then fallback count, then count.
    if fallback_counts is not None:
        order = order[torch.sort(-fallback_counts.long()[order], stable=True).indices]
    order = order[torch.sort(-counts.long()[order], stable=True).indices]
    chosen = torch.sort(order[:draft_vocab_size]).values
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t.to(torch.int64), t2d


def draft_ids_to_target(d2t: torch.Tensor) -> torch.Tensor:
    return torch.arange(d2t.numel()) + d2t


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Share of (loss-masked) tokens that the draft vocabulary can propose."""
    total = counts.sum().item()
    return float(counts[t2d].sum().item() / total) if total else 0.0


def d2t_sha256(d2t: torch.Tensor) -> str:
    return hashlib.sha256(d2t.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()
