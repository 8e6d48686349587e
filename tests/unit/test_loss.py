"""The chunked TTT loss equals the plain soft cross-entropy, values and gradients."""

import pytest
import torch

from eagle3lib.train.loss import LOSS_TARGETS, linear_soft_ce, target_probs


def plain(h, weight, target_logits, valid, offset):
    z = h @ weight.T
    p = torch.softmax(target_logits, -1)
    p = torch.nn.functional.pad(p[:, offset:], (0, 0, 0, offset))
    ce = -(p * torch.log_softmax(z, -1)).sum(-1)
    return torch.where(valid, ce, 0.0).sum(), z.argmax(-1)


@pytest.mark.parametrize("only_valid", [False, True], ids=["all-rows", "valid-rows"])
@pytest.mark.parametrize("fused", [False, True], ids=["eager", "compiled"])
def test_chunked_loss_and_gradients_equal_the_plain_soft_ce(fused, only_valid):
    """fused: the per-chunk kernel through torch.compile (as on CUDA), here compiled for the CPU.
    only_valid: only the valid rows scored, gathered across rows of the batch; the argmax is compared there."""
    torch.manual_seed(0)
    b, t, hdim, vocab = 2, 37, 16, 50
    h = torch.randn(b, t, hdim, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, hdim, dtype=torch.float64, requires_grad=True)
    final = torch.randn(b, t, 12, dtype=torch.float64)
    head = torch.randn(vocab, 12, dtype=torch.float64)
    valid = torch.rand(b, t) > 0.3
    offset = 3
    valid[:, t - offset :] = False  # no target beyond the row, as valid_positions makes it
    expected, expected_best = plain(h, weight, final @ head.T, valid, offset)
    gh, gw = torch.autograd.grad(expected, (h, weight))
    probs = target_probs(final, head, torch.float64, chunk_elements=7 * vocab)
    loss, best = linear_soft_ce(
        h,
        weight,
        probs,
        valid,
        offset=offset,
        chunk_elements=5 * vocab,  # 5-row chunks
        fused=fused,
        only_valid=only_valid,
    )
    assert torch.allclose(loss, expected.float(), rtol=1e-6)
    assert torch.equal(best[valid], expected_best[valid])
    assert torch.equal(best, expected_best) or only_valid
    dh, dw = torch.autograd.grad(2.5 * loss, (h, weight))
    assert (dh - 2.5 * gh).abs().max() < 1e-6 * gh.abs().max(), (dh - 2.5 * gh).abs().max()
    assert (dw - 2.5 * gw).abs().max() < 1e-6 * gw.abs().max(), (dw - 2.5 * gw).abs().max()


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "compiled"])
def test_without_gradients_it_only_scores(fused):
    h, weight = torch.randn(8, 4), torch.randn(6, 4)
    probs = torch.softmax(torch.randn(8, 6), -1)
    with torch.no_grad():
        loss, best = linear_soft_ce(h, weight, probs, torch.ones(8, dtype=torch.bool), fused=fused)
    assert loss > 0 and torch.equal(best, (h @ weight.T).argmax(-1))


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: bf16 through the compiled kernel and addmm's fp32 output"
)
@pytest.mark.parametrize("only_valid", [False, True], ids=["all-rows", "valid-rows"])
def test_bf16_on_cuda_is_close_to_the_fp64_loss_and_gradients(only_valid):
    torch.manual_seed(0)
    n, hdim, vocab = 3000, 256, 4000  # several chunks, the last one short
    h64 = torch.randn(n, hdim, dtype=torch.float64, device="cuda") * 0.5
    w64 = torch.randn(vocab, hdim, dtype=torch.float64, device="cuda") * 0.1
    target = torch.randn(n, vocab, dtype=torch.float64, device="cuda")
    valid = torch.rand(n, device="cuda") > 0.2
    valid[-2:] = False
    h64.requires_grad_(), w64.requires_grad_()
    expected, _ = plain(h64[None], w64, target[None], valid[None], 2)  # plain shifts along dim 1
    gh, gw = torch.autograd.grad(expected, (h64, w64))
    h, w = h64.detach().float().requires_grad_(), w64.detach().float().requires_grad_()
    probs = torch.softmax(target, -1).to(torch.bfloat16)
    loss, _ = linear_soft_ce(
        h, w, probs, valid, offset=2, dtype=torch.bfloat16, chunk_elements=1024 * vocab, only_valid=only_valid
    )
    dh, dw = torch.autograd.grad(loss, (h, w))
    assert abs(loss.item() - expected.item()) < 1e-2 * abs(expected.item())
    assert (dh - gh).norm() < 2e-2 * gh.norm(), ((dh - gh).norm() / gh.norm()).item()
    assert (dw - gw).norm() < 2e-2 * gw.norm(), ((dw - gw).norm() / gw.norm()).item()


def test_top_token_target_is_the_cross_entropy_on_the_targets_argmax():
    """train.loss_target top_token: the loss is F.cross_entropy against the argmax of the target's draft-vocab
    logits, made in chunks like the distribution."""
    torch.manual_seed(1)
    h = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(30, 8, dtype=torch.float64)
    final, head = torch.randn(11, 5, dtype=torch.float64), torch.randn(30, 5, dtype=torch.float64)
    onehot = LOSS_TARGETS["top_token"](final, head, torch.float64, chunk_elements=4 * 30)
    assert torch.equal(onehot.argmax(-1), (final @ head.T).argmax(-1)) and torch.equal(onehot.sum(-1), torch.ones(11))
    valid = torch.ones(11, dtype=torch.bool)
    loss, _ = linear_soft_ce(h, weight, onehot, valid, offset=0, fused=False)
    expected = torch.nn.functional.cross_entropy(h @ weight.T, (final @ head.T).argmax(-1), reduction="sum")
    assert torch.allclose(loss, expected.float(), rtol=1e-6)
    assert LOSS_TARGETS["distribution"] is target_probs
