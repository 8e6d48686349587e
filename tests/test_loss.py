"""The chunked TTT loss equals the plain soft cross-entropy, values and gradients."""
import torch

from eagle3lib.loss import linear_soft_ce, target_probs


def plain(h, weight, target_logits, valid, offset):
    z = h @ weight.T
    p = torch.softmax(target_logits, -1)
    p = torch.nn.functional.pad(p[:, offset:], (0, 0, 0, offset))
    ce = -(p * torch.log_softmax(z, -1)).sum(-1)
    return torch.where(valid, ce, 0.0).sum(), z.argmax(-1)


def test_chunked_loss_and_gradients_equal_the_plain_soft_ce():
    torch.manual_seed(0)
    b, t, hdim, vocab = 2, 37, 16, 50
    h = torch.randn(b, t, hdim, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, hdim, dtype=torch.float64, requires_grad=True)
    final = torch.randn(b, t, 12, dtype=torch.float64)
    head = torch.randn(vocab, 12, dtype=torch.float64)
    valid = torch.rand(b, t) > 0.3
    offset = 3
    valid[:, t - offset:] = False  # no target beyond the row, as valid_positions makes it
    expected, expected_best = plain(h, weight, final @ head.T, valid, offset)
    gh, gw = torch.autograd.grad(expected, (h, weight))
    probs = target_probs(final, head, torch.float64, chunk_elements=7 * vocab)
    loss, best = linear_soft_ce(h, weight, probs, valid, offset=offset, chunk_elements=5 * vocab)  # 5-row chunks
    assert torch.allclose(loss, expected.float(), rtol=1e-6)
    assert torch.equal(best, expected_best)
    dh, dw = torch.autograd.grad(2.5 * loss, (h, weight))
    assert (dh - 2.5 * gh).abs().max() < 1e-6 * gh.abs().max(), (dh - 2.5 * gh).abs().max()
    assert (dw - 2.5 * gw).abs().max() < 1e-6 * gw.abs().max(), (dw - 2.5 * gw).abs().max()


def test_without_gradients_it_only_scores():
    h, weight = torch.randn(8, 4), torch.randn(6, 4)
    probs = torch.softmax(torch.randn(8, 6), -1)
    with torch.no_grad():
        loss, best = linear_soft_ce(h, weight, probs, torch.ones(8, dtype=torch.bool))
    assert loss > 0 and torch.equal(best, (h @ weight.T).argmax(-1))
