"""benchmarks/al_interval.py: the served-AL ratio of two configurations and its two-level bootstrap interval
(seeds, and prompts paired across drafters), on rows made here with known acceptance."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("al_interval", ROOT / "benchmarks" / "al_interval.py")
al_interval = importlib.util.module_from_spec(spec)
spec.loader.exec_module(al_interval)


def rows(config: str, seed_al: dict[int, np.ndarray], sets=("mt_bench", "gsm8k"), depth=3, tokens=96) -> list[dict]:
    """One row per seed and set, every prompt `tokens` long at the given per-prompt accept lengths."""
    trainer, name = config.split(":")
    return [
        {
            "trainer": trainer,
            "config": name,
            "seed": seed,
            "depth": depth,
            "set": s,
            "per_prompt": [[f"{s}-{i}", tokens, float(al)] for i, al in enumerate(als)],
        }  # fmt: skip
        for seed, als in seed_al.items()
        for s in sets
    ]


def test_equal_drafters_give_one_and_a_lead_is_seen():
    rng = np.random.default_rng(1)
    prompts = rng.uniform(1.2, 2.2, size=60)  # prompts differ far more than the drafters do
    base = rows("peer:defaults", {s: prompts * rng.normal(1, 0.005, 60) for s in range(3)})
    same = rows("ours:same", {s: prompts * rng.normal(1, 0.005, 60) for s in range(3)})
    lead = rows("ours:lead", {s: prompts * 1.05 * rng.normal(1, 0.005, 60) for s in range(3)})
    out = {(c["a"], c["depth"]): c for c in al_interval.ratios(base + same + lead, "peer:defaults", 2000)}
    same_mean, lead_mean = out[("ours:same", 3)]["mean"], out[("ours:lead", 3)]["mean"]
    assert same_mean["low"] < 1.0 < same_mean["high"] and abs(same_mean["ratio"] - 1) < 0.01
    # paired by prompt: a 5% lead on every prompt is resolved although the prompts' AL spreads over 1.2-2.2
    assert 1.0 < lead_mean["low"] < 1.05 < lead_mean["high"] < 1.07
    assert out[("ours:lead", 3)]["seeds"] == {"ours:lead": 3, "peer:defaults": 3}
    assert out[("ours:lead", 3)]["prompts"] == {"gsm8k": 60, "mt_bench": 60}
    assert "ours:lead / peer:defaults | 3 | 3 / 3" in al_interval.table(list(out.values()))
    # each configuration's own AL interval holds its point; the prompts' spread makes it far wider than the ratio's
    for config, (low, high) in lead_mean["al_interval"].items():
        assert low < lead_mean["al"][config] < high and (high - low) / lead_mean["al"][config] > 0.03


def test_seed_spread_widens_the_interval():
    """A lead that one seed of three makes: the seed level of the bootstrap must not call it certain."""
    rng = np.random.default_rng(2)
    prompts = rng.uniform(1.2, 2.2, size=60)
    base = rows("peer:defaults", dict.fromkeys(range(3), prompts))
    lucky = rows("ours:lucky", {0: prompts * 1.15, 1: prompts * 0.98, 2: prompts * 0.99})
    (c,) = al_interval.ratios(base + lucky, "peer:defaults", 4000)
    assert c["mean"]["ratio"] == pytest.approx((1.15 + 0.98 + 0.99) / 3, rel=1e-6)
    assert c["mean"]["low"] < 1.0 < c["mean"]["high"]


def test_set_al_is_tokens_over_steps_and_unpaired_prompts_are_left_out():
    base = rows("peer:defaults", {0: np.array([1.0, 2.0, 4.0])}, sets=("mt_bench",))
    other = rows("ours:x", {0: np.array([2.0, 2.0])}, sets=("mt_bench",))  # served only the first two prompts
    (c,) = al_interval.ratios(base + other, "peer:defaults", 500)
    # base over its first two prompts: 192 tokens / (96 + 48) steps; the third prompt is not compared
    assert c["prompts"] == {"mt_bench": 2}
    assert c["per_set"]["mt_bench"]["al"]["peer:defaults"] == pytest.approx(192 / 144)
    assert c["per_set"]["mt_bench"]["ratio"] == pytest.approx(2.0 / (192 / 144))
    # a configuration that was not served at all gives no comparison, and the CLI says what is missing
    assert al_interval.ratios(base, "peer:defaults") == []
