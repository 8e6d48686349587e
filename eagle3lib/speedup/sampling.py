"""Is speculative sampling lossless in distribution? A permutation test on sampled sequences.

With temperature > 0 the engine's rejection sampling must leave the output distribution unchanged, so token
for token comparison does not apply: we compare N independent samples per prompt drawn with speculation
against N drawn without it.

Statistic: per prompt, the chi-square of homogeneity of the 2 x K table of token counts pooled over all
positions of all samples of each side (tokens seen fewer than `min_count` times in total share one 'other'
column), summed over prompts. Tokens inside one sequence are not independent, so the chi-square
distribution's p-value would be wrong; the p-value comes instead from a permutation test that shuffles the
plain/speculative labels of whole sequences (which are i.i.d. under the null) within each prompt.
"""

from __future__ import annotations

import numpy as np


def _table(plain: list[list[int]], speculative: list[list[int]], min_count: int) -> tuple[np.ndarray, int]:
    """Per-sequence token counts (sequences x K columns, plain rows first, rare tokens in a last 'other'
    column) and the number of plain rows. Columns follow the total counts, which no relabelling changes."""
    seqs = [np.asarray(s, dtype=np.int64).ravel() for s in plain + speculative]
    _, inverse, total = np.unique(np.concatenate(seqs), return_inverse=True, return_counts=True)
    kept = total >= min_count
    column = np.where(kept, np.cumsum(kept) - 1, kept.sum())[inverse]
    row = np.repeat(np.arange(len(seqs)), [len(s) for s in seqs])
    counts = np.zeros((len(seqs), kept.sum() + 1))
    np.add.at(counts, (row, column), 1)
    return counts[:, counts.sum(0) > 0], len(plain)  # without an empty 'other' column


def _chi2(first: np.ndarray, column: np.ndarray) -> np.ndarray:
    """Chi-square of homogeneity of 2 x K tables given the first rows (... x K) and the fixed column totals."""
    n = column.sum()
    rows = (first, column - first)
    stat = np.zeros(first.shape[:-1])
    for obs in rows:
        expected = obs.sum(-1, keepdims=True) * column / n
        stat += np.divide((obs - expected) ** 2, expected, out=np.zeros_like(obs), where=expected > 0).sum(-1)
    return stat


def distribution_check(
    plain: dict[str, list[list[int]]],
    speculative: dict[str, list[list[int]]],
    permutations: int = 2000,
    seed: int = 0,
    min_count: int = 5,
    alpha: float = 0.01,
) -> dict:
    """Test "speculative samples follow the same distribution as plain ones" for prompt id -> list of sampled
    token-id sequences on each side; see the module docstring for the statistic and the permutation p-value,
    p = (1 + #{permuted statistic >= observed}) / (1 + permutations), so it is never below 1/(1+permutations).

    Returns the overall statistic, p_value, permutations, prompts, samples (both sides), alpha, passed
    (p_value >= alpha), and per prompt ("per_prompt": id -> dict) the samples and tokens per side, the
    statistic, its own permutation p-value, and the total variation distance between the two sides' pooled
    token frequencies (over the same columns as the statistic)."""
    if set(plain) != set(speculative):
        missing = sorted(set(plain) ^ set(speculative))
        raise ValueError(f"prompt {missing[0]!r} is in only one of plain and speculative (all such: {missing})")
    if not plain:
        raise ValueError("no prompts to compare")
    if permutations < 1:
        raise ValueError(f"permutations must be >= 1, got {permutations}")
    for pid in sorted(plain):
        for side, samples in (("plain", plain[pid]), ("speculative", speculative[pid])):
            if len(samples) < 2:
                raise ValueError(f"prompt {pid!r}: {side} has {len(samples)} samples; at least 2 are needed")

    rng = np.random.default_rng(seed)
    per_prompt, observed, permuted = {}, 0.0, np.zeros(permutations)
    for pid in sorted(plain):
        counts, n_plain = _table(plain[pid], speculative[pid], min_count)
        column = counts.sum(0)
        first = counts[:n_plain].sum(0)
        stat = float(_chi2(first, column))
        labels = np.zeros((permutations, len(counts)))
        labels[:, :n_plain] = 1.0
        perm_stats = _chi2(rng.permuted(labels, axis=1) @ counts, column)
        observed += stat
        permuted += perm_stats
        second = column - first
        tv = 0.5 * float(np.abs(first / max(first.sum(), 1) - second / max(second.sum(), 1)).sum())
        per_prompt[pid] = {
            "samples": [n_plain, len(counts) - n_plain],
            "tokens": [int(first.sum()), int(second.sum())],
            "statistic": stat,
            "p_value": _p_value(perm_stats, stat, permutations),
            "tv_distance": tv,
        }
    p_value = _p_value(permuted, observed, permutations)
    return {
        "statistic": observed,
        "p_value": p_value,
        "permutations": permutations,
        "prompts": len(per_prompt),
        "samples": sum(sum(r["samples"]) for r in per_prompt.values()),
        "alpha": alpha,
        "passed": p_value >= alpha,
        "per_prompt": per_prompt,
    }


def _p_value(permuted: np.ndarray, observed: float, permutations: int) -> float:
    """Share of permuted statistics at least the observed one (with a float tolerance), counting the observed."""
    at_least = int((permuted >= observed - 1e-9 * max(1.0, abs(observed))).sum())
    return (1 + at_least) / (1 + permutations)


def sampling_text(check: dict) -> str:
    """A few lines: the verdict with what it means, then each prompt's TV distance."""
    head = (
        f"speculative vs plain sampling: chi-square {check['statistic']:.1f} over {check['prompts']} prompts, "
        f"{check['samples']} samples; permutation p = {check['p_value']:.4g} ({check['permutations']} permutations)"
    )
    if check["passed"]:
        verdict = f"passed (p >= {check['alpha']}): no evidence that speculation changes the sampled distribution"
    else:
        verdict = (
            f"FAILED (p < {check['alpha']}): the speculative samples' token distribution differs from plain "
            "decoding beyond chance, so the rejection sampling is not lossless (or the two runs did not "
            "sample with the same settings)"
        )
    lines = [head, verdict]
    for pid, r in check["per_prompt"].items():
        lines.append(
            f"  {pid}: TV distance {r['tv_distance']:.3f}, chi-square {r['statistic']:.1f}, p {r['p_value']:.3g} "
            f"({r['samples'][0]}/{r['samples'][1]} samples, {r['tokens'][0]}/{r['tokens'][1]} tokens)"
        )
    return "\n".join(lines)
