"""Which positions and targets the TTT loss and its metrics use, checked by hand on a packed row of two documents,
and the learning-rate schedule.

Step k at position t is fed token t+1+k and is scored against the target's distribution at t+1+k (the one that
predicts token t+2+k), only where token t+2+k is an assistant token (loss mask) of t's document. An off-by-one
shared by the loss and the metrics would pass every other test; here the target is a perfect next-token
predictor, so each score names the token it stands for.
"""

import pytest
import torch
from transformers import LlamaConfig

from eagle3lib.drafter import Drafter, DrafterConfig
from eagle3lib.drafter.vocab import build_draft_vocab
from eagle3lib.train import ttt_step
from eagle3lib.train.runtime import optimizer
from eagle3lib.train.runtime.batches import Sequence, make_batch

VOCAB = HIDDEN = 16
# two documents packed in one row of 11 (two padding slots at the end); tokens distinct so each names its position
DOC_A = {"ids": [1, 2, 3, 4, 5], "mask": [0, 0, 1, 1, 1]}  # prompt 1 2, reply 3 4 5
DOC_B = {"ids": [6, 7, 8, 9], "mask": [0, 1, 1, 1]}  # prompt 6, reply 7 8 9
ROW = DOC_A["ids"] + DOC_B["ids"]
# step k at t is valid where t+1+k and t+2+k lie in t's document and t+2+k is a reply token
VALID = {0: [0, 1, 2, 5, 6], 1: [0, 1, 5], 2: [0]}


def sequence(doc):
    n = len(doc["ids"])
    ids = torch.tensor(doc["ids"])
    nxt = ROW[ROW.index(doc["ids"][0]) + 1 :] + [0]
    # a perfect target: its final state at t is the next token of the row, through an identity lm_head
    final = 10.0 * torch.nn.functional.one_hot(torch.tensor(nxt[:n]), VOCAB).float()
    return Sequence(ids, torch.tensor(doc["mask"], dtype=torch.uint8), torch.randn(n, 3 * HIDDEN), final)


@pytest.fixture
def spied(monkeypatch):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_attention_heads=2, num_hidden_layers=4
    )
    drafter = Drafter(DrafterConfig.from_target(cfg, 12, [1, 2, 3]))
    counts = torch.zeros(VOCAB)
    counts[torch.tensor(ROW)] = 1.0
    drafter.set_vocab(*build_draft_vocab(counts, 12))  # the 9 row tokens and 3 others; 12 < 16 maps ids
    batch = make_batch([[sequence(DOC_A), sequence(DOC_B)]], 11)
    embed = torch.randn(VOCAB, HIDDEN)
    calls, fed = [], {}
    real_ce, real_ttt = ttt_step.linear_soft_ce, drafter.ttt_forward

    def record_ce(h, weight, probs, valid, offset, **kw):
        loss, best = real_ce(h, weight, probs, valid, offset=offset, **kw)
        calls.append({"probs": probs, "valid": valid, "offset": offset, "best": best})
        return loss, best

    def record_ttt(aux, embeds, *args, **kw):
        fed["embeds"] = embeds
        return real_ttt(aux, embeds, *args, **kw)

    monkeypatch.setattr(ttt_step, "linear_soft_ce", record_ce)
    monkeypatch.setattr(drafter, "ttt_forward", record_ttt)
    sums, counts_k, rights, valids = ttt_step.ttt_loss_sums(drafter, batch, embed, torch.eye(VOCAB), 3)
    return drafter, batch, embed, calls, fed, counts_k, rights, valids


def test_valid_positions_by_hand(spied):
    _, batch, _, calls, _, counts, _, valids = spied
    for k, want in VALID.items():
        assert valids[k][0].nonzero().flatten().tolist() == want, k
        assert calls[k]["valid"][0].nonzero().flatten().tolist() == want
        assert counts[k] == len(want)
    assert batch["doc_ids"][0].tolist() == [0] * 5 + [1] * 4 + [-1, -1]


def test_step_k_at_t_is_fed_token_t_plus_1_plus_k_and_scored_against_token_t_plus_2_plus_k(spied):
    drafter, _, embed, calls, fed, _, rights, _ = spied
    embeds = fed["embeds"][0]
    for k, positions in VALID.items():
        probs = calls[k]["probs"].view(1, 11, -1)[0]
        assert calls[k]["offset"] == 1 + k
        for t in positions:
            assert torch.equal(embeds[t + k], embed[ROW[t + 1 + k]]), (k, t)
            # the target distribution the step is scored against names the token two ahead of the fed one
            scored = drafter.draft_to_target(probs[t + 1 + k].argmax()).item()
            assert scored == ROW[t + 2 + k], (k, t, scored)
            # the metric: the draft's own argmax against that same token
            drafted = drafter.draft_to_target(calls[k]["best"][0, t]).item()
            assert bool(rights[k][0, t]) == (drafted == ROW[t + 2 + k]), (k, t)


def test_learning_rate_warms_up_linearly_then_decays_by_cosine_to_a_tenth():
    lr, total, warmup = 1e-3, 110, 10
    assert [optimizer.lr_at(s, total, lr, warmup) for s in (0, 4, 9)] == pytest.approx([1e-4, 5e-4, 1e-3])
    assert optimizer.lr_at(10, total, lr, warmup) == pytest.approx(lr)  # the peak, where the cosine starts
    assert optimizer.lr_at(60, total, lr, warmup) == pytest.approx(lr * (0.1 + 0.9 * 0.5))  # halfway down
    assert optimizer.lr_at(110, total, lr, warmup) == pytest.approx(0.1 * lr)
    assert optimizer.lr_at(500, total, lr, warmup) == pytest.approx(0.1 * lr)  # past the end: held at the floor
    decay = [optimizer.lr_at(s, total, lr, warmup) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert optimizer.lr_at(0, 1, lr, 0) == pytest.approx(lr)  # no warm-up, one step


def test_the_host_layout_changes_nothing_but_where_it_is_made(spied):
    """with_host_layout (the rows' layout and each step's valid rows made before the batch moves, as the trainer
    does) gives the loss, counts and metrics of the same batch without it, where they are read back inside the
    step; its valid rows are the valid masks', and the merged attention takes its layout."""
    drafter, batch, embed, _, _, counts, rights, valids = spied
    hosted = ttt_step.with_host_layout(batch, 3)
    assert [r.tolist() for r in hosted["loss_rows"]] == [VALID[k] for k in range(3)]  # one row: flat = position
    assert not hosted["row_layout"].one_document and hosted["row_layout"].segments.cu_seqlens.tolist() == [0, 5, 9, 11]
    for attention in ("dense", "merged"):
        ref = ttt_step.ttt_loss_sums(drafter, batch, embed, torch.eye(VOCAB), 3, attention=attention)
        got = ttt_step.ttt_loss_sums(drafter, hosted, embed, torch.eye(VOCAB), 3, attention=attention)
        torch.testing.assert_close(got[0], ref[0])
        for a, b in zip(got[1:], ref[1:]):
            assert torch.equal(a, b), attention
