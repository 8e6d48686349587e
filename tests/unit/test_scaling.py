"""benchmarks/questions/scaling.py: served AL against training tokens from each size's served summaries, each
trainer's interval and the ratio's, and its refusals of input it cannot use."""

import json

import numpy as np
import pytest

from benchmarks.questions import scaling


def summary(path, lead: float, seed_spread=0.005, prompts=40, sets=("mt_bench", "gsm8k"), depth=3):
    """A served_al summary: ours:defaults at `lead` times speculators:sglang's per-prompt accept length, 3 seeds."""
    rng = np.random.default_rng(int(lead * 1000))
    base = rng.uniform(1.3, 2.3, size=prompts)
    rows = []
    for trainer, config, scale in (("ours", "defaults", lead), ("speculators", "sglang", 1.0)):
        for seed in range(3):
            als = base * scale * rng.normal(1, seed_spread, prompts)
            rows += [
                {
                    "trainer": trainer,
                    "config": config,
                    "seed": seed,
                    "depth": depth,
                    "set": s,
                    "per_prompt": [[f"{s}-{i}", 64, float(al)] for i, al in enumerate(als)],
                }  # fmt: skip
                for s in sets
            ]
    path.write_text(json.dumps({"rows": rows}))
    return path


def test_each_size_gives_both_trainers_al_with_intervals_and_the_ratio(tmp_path, capsys):
    small = summary(tmp_path / "small.json", 1.03)
    large = summary(tmp_path / "large.json", 1.08)
    out = tmp_path / "res" / "scaling.json"
    assert scaling.main(["--size", f"600000={small}", "--size", f"5000000={large}", "--resamples", "800",
                         "--out", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())
    assert [(r["train_tokens"], r["depth"]) for r in rows] == [(600000, 3), (5000000, 3)]
    for r, lead in zip(rows, (1.03, 1.08), strict=True):
        assert r["low"] < r["ratio"] < r["high"] and r["ratio"] == pytest.approx(lead, abs=0.01)
        for name in ("ours:defaults", "speculators:sglang"):
            low, high = r["al_interval"][name]
            assert low < r["al"][name] < high
        assert set(r["per_set"]) == {"mt_bench", "gsm8k"} and r["seeds"] == {
            "ours:defaults": 3,
            "speculators:sglang": 3,
        }
    assert rows[1]["low"] > rows[0]["high"]  # a lead of 8% against 3%, 3 seeds of 80 prompts: told apart
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert "| 5,000,000 | 3 | 3 / 3 |" in out.with_suffix(".md").read_text()
    assert scaling.headline(rows)["largest_train_tokens"] == 5000000
    assert scaling.headline(rows)["ratio_d3"] == pytest.approx(rows[1]["ratio"], abs=1e-4)
    assert capsys.readouterr().out.count('{"train_tokens"') == 2


def test_input_it_cannot_use_is_named_with_what_to_give(tmp_path):
    good = summary(tmp_path / "s.json", 1.05)
    with pytest.raises(SystemExit, match=r"--size '600k=.*': expected TRAINING_TOKENS=SUMMARY_JSON"):
        scaling.sized_summaries([f"600k={good}"])
    with pytest.raises(SystemExit, match=r"missing.json is not a file"):
        scaling.sized_summaries([f"600000={tmp_path / 'missing.json'}"])
    with pytest.raises(SystemExit, match=r"no prompts that both ours:allpos and speculators:sglang served.*"
                                         r"these hold ours:defaults, speculators:sglang.*--ours / --peer"):  # fmt: skip
        scaling.main(["--size", f"600000={good}", "--ours", "ours:allpos", "--out", str(tmp_path / "x.json")])
