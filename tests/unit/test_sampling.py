"""bench.sampling.distribution_check against a small reference of speculative sampling on toy Markov chains:
the correct rejection sampling (Leviathan et al. 2023; Chen et al. 2023) must pass against plain sampling
from the target, a broken variant (rejections resample from the target instead of the residual) must fail."""

import functools

import numpy as np
import pytest

from eagle3lib.speedup.sampling import distribution_check, sampling_text

VOCAB, LENGTH, DEPTH, SAMPLES = 8, 12, 3, 256  # at 64 samples a side the broken variant fails only about 1 time in 3
PROMPTS = {f"prompt-{i}": i for i in range(4)}  # prompt id -> the token the sequence continues from


def _chain(seed: int) -> np.ndarray:
    """A toy Markov model: row prev is p(next | prev)."""
    return np.random.default_rng(seed).dirichlet(np.ones(VOCAB), size=VOCAB)


TARGET, DRAFT = _chain(1), _chain(2)


def _draw(rng, probs) -> int:
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), VOCAB - 1))


def plain_sample(rng, prev: int, p=TARGET) -> list[int]:
    """Autoregressive sampling from p."""
    out = []
    for _ in range(LENGTH):
        prev = _draw(rng, p[prev])
        out.append(prev)
    return out


def step_distribution(p: np.ndarray, q: np.ndarray, broken: bool) -> np.ndarray:
    """The exact distribution of one token emitted after a draft from q: accepted with min(1, p/q), else
    drawn from the residual normalize(max(p - q, 0)) (or from p itself when broken)."""
    accepted = np.minimum(p, q)
    residual = np.maximum(p - q, 0)
    fallback = p if broken else residual / residual.sum()
    return accepted + (1 - accepted.sum()) * fallback


def speculative_sample(rng, prev: int, broken: bool = False) -> list[int]:
    """Speculative sampling with chains of DEPTH draft tokens from DRAFT verified against TARGET."""
    out = []
    while len(out) < LENGTH:
        drafts, ctx = [], prev
        for _ in range(DEPTH):
            ctx = _draw(rng, DRAFT[ctx])
            drafts.append(ctx)
        ctx = prev
        for x in drafts:
            p, q = TARGET[ctx], DRAFT[ctx]
            if rng.random() < min(1.0, p[x] / q[x]):
                out.append(x)
                ctx = x
                continue
            residual = p if broken else np.maximum(p - q, 0)
            out.append(_draw(rng, residual))
            break
        else:
            out.append(_draw(rng, TARGET[ctx]))  # every draft accepted: the bonus token
        prev = out[-1]
    return out[:LENGTH]


@functools.cache
def _samples(sampler, seed: int, n: int = SAMPLES) -> dict[str, list[list[int]]]:
    """n sequences per prompt (cached: tests only read them)."""
    rng = np.random.default_rng(seed)
    return {pid: [sampler(rng, start) for _ in range(n)] for pid, start in PROMPTS.items()}


def _broken(rng, prev):
    return speculative_sample(rng, prev, broken=True)


def _draft_only(rng, prev):
    return plain_sample(rng, prev, DRAFT)


def test_reference_step_distributions():
    """The failure below is a real difference in distribution, not an artefact of the sample size: exactly,
    the correct step reproduces the target's next-token distribution and the broken one does not."""
    for prev in range(VOCAB):
        p, q = TARGET[prev], DRAFT[prev]
        np.testing.assert_allclose(step_distribution(p, q, broken=False), p, atol=1e-12)
        assert 0.5 * np.abs(step_distribution(p, q, broken=True) - p).sum() > 0.05


@pytest.mark.parametrize("seed", [10, 11])
def test_correct_speculative_sampling_passes(seed):
    check = distribution_check(_samples(plain_sample, seed), _samples(speculative_sample, seed + 100), seed=seed)
    assert check["passed"] and check["p_value"] >= 0.01, sampling_text(check)
    assert check["prompts"] == 4 and check["samples"] == 2 * 4 * SAMPLES
    assert all(r["tokens"] == [SAMPLES * LENGTH] * 2 for r in check["per_prompt"].values())


def test_broken_speculative_sampling_fails():
    check = distribution_check(_samples(plain_sample, 10), _samples(_broken, 110))
    assert not check["passed"] and check["p_value"] < 0.01, sampling_text(check)
    assert "FAILED" in sampling_text(check)


def test_plainly_different_distribution_fails():
    """The passes above are not for want of power: sampling from the draft alone is rejected at once."""
    draft = _samples(_draft_only, 11)
    check = distribution_check(_samples(plain_sample, 10), draft)
    assert check["p_value"] == 1 / (1 + check["permutations"])
    assert all(r["tv_distance"] > 0.05 for r in check["per_prompt"].values())


def test_null_calibrated():
    """Tokens within a sequence depend on each other, yet under the null the permutation p-value is not too
    small too often: plain vs plain over 30 seeds gives p < 0.1 about 3 times (9 or more: chance 0.2%)."""
    p = [
        distribution_check(_samples(plain_sample, s, 32), _samples(plain_sample, s + 1000, 32), 200, seed=s)["p_value"]
        for s in range(30)
    ]
    assert sum(x < 0.1 for x in p) <= 8 and max(p) > 0.5


def test_identical_samples():
    samples = _samples(plain_sample, 3, n=8)
    check = distribution_check(samples, samples, permutations=200)
    assert check["statistic"] == 0 and check["p_value"] == 1 and check["passed"]
    assert all(r["tv_distance"] == 0 for r in check["per_prompt"].values())
    assert "passed" in sampling_text(check)


def test_deterministic_and_ragged():
    """Same seed, same answer; sequences of different lengths (stopped early) are counted as they are."""
    plain = {"a": [[1, 2, 3], [1, 2], [4] * 7, []]}
    spec = {"a": [[1, 2, 3, 3], [2], [4, 4, 1]]}
    first, second = distribution_check(plain, spec, permutations=300), distribution_check(plain, spec, permutations=300)
    assert first == second
    assert first["per_prompt"]["a"]["samples"] == [4, 3] and first["per_prompt"]["a"]["tokens"] == [12, 8]


def test_errors_name_the_prompt():
    two = [[1, 2], [2, 1]]
    with pytest.raises(ValueError, match="'b'"):
        distribution_check({"a": two, "b": two}, {"a": two})
    with pytest.raises(ValueError, match="'c'"):
        distribution_check({"a": two}, {"a": two, "c": two})
    with pytest.raises(ValueError, match="'a'.*speculative has 1 samples"):
        distribution_check({"a": two}, {"a": [[1, 2]]})
    with pytest.raises(ValueError, match="'a'.*plain has 0 samples"):
        distribution_check({"a": []}, {"a": two})
