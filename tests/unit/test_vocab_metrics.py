"""Draft vocabulary and the acceptance metrics (docs/design.md §5)."""

import pytest
import torch

from eagle3lib.drafter.vocab import build_draft_vocab, coverage, d2t_sha256, draft_ids_to_target, token_counts
from eagle3lib.train.metrics import AcceptanceCounter, acceptance_summary


def test_draft_vocab_is_the_most_frequent_loss_masked_tokens():
    ids = torch.tensor([5, 5, 5, 9, 9, 2, 7, 7, 7, 7, 1])
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 1])  # 7 is frequent but never predicted
    counts = token_counts(ids, mask, 12)
    d2t, t2d = build_draft_vocab(counts, 3)
    assert draft_ids_to_target(d2t).tolist() == [1, 5, 9]  # 1 and 2 tie at 1: the lower id wins
    assert d2t.dtype == torch.int64 and (d2t >= 0).all()
    assert t2d.tolist() == [i in (1, 5, 9) for i in range(12)]
    assert coverage(counts, t2d) == pytest.approx(6 / 7)
    assert len(d2t_sha256(d2t)) == 64


def test_draft_vocab_fills_up_with_unseen_ids_and_checks_size():
    counts = torch.tensor([0, 3, 0, 0, 1])
    d2t, t2d = build_draft_vocab(counts, 4)
    assert draft_ids_to_target(d2t).tolist() == [0, 1, 2, 4]
    with pytest.raises(ValueError, match="1..5"):
        build_draft_vocab(counts, 6)


def test_metrics_condition_on_earlier_steps():
    # 4 positions, 3 steps.
    right = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    valid = torch.ones_like(right)
    c = AcceptanceCounter(3)
    c.update(right, valid)
    s = c.summary(max_depth=5)
    assert s["step_acc"] == pytest.approx([0.75, 0.75, 0.75])
    # cond: step1 among {0,1,2} right at 0 -> 2/3; step2 among positions right at 0 and 1 -> {0,2}: 1/2
    assert s["cond_acc"] == pytest.approx([0.75, 2 / 3, 0.5])
    assert s["joint_acc"] == pytest.approx([0.75, 0.5, 0.25])
    assert float(s["est_accept_len"]["3"]) == pytest.approx(1 + 0.75 + 0.5 + 0.25)
    # Depth 5 extends with the last conditional acceptance and says so.
    assert float(s["est_accept_len"]["5"]) == pytest.approx(2.5 + 0.125 + 0.0625)
    assert s["extrapolated_depths"] == [4, 5]


def test_invalid_positions_are_not_counted():
    right = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    valid = torch.tensor([[1, 0], [1, 0]], dtype=torch.bool)
    c = AcceptanceCounter(2)
    c.update(right, valid)
    assert c.summary()["step_acc"] == [1.0, 1.0]
    assert acceptance_summary([0.5], [0.5], 2)["est_accept_len"] == {"1": 1.5, "2": 1.75}


def test_unfilled_slots_go_to_the_fallback_ranking():
    counts = torch.tensor([0, 3, 0, 0, 1, 0])
    fallback = torch.tensor([0, 9, 0, 5, 1, 7])
    d2t, _ = build_draft_vocab(counts, 4, fallback_counts=fallback)
    assert draft_ids_to_target(d2t).tolist() == [1, 3, 4, 5]
