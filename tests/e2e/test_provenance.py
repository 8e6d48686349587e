"""provenance.py: greedy speculative decoding replayed with our drafter on the real SmolLM2 is lossless, and
labels every token with how it came."""

import pytest
import torch
from drafters import MAX_TOKENS, tiny_drafter

from eagle3lib.speedup import replay


@pytest.fixture(scope="module")
def setup(embedded_target, learned):
    """The real target, two prompts with their greedy continuations (one token per forward), a random tiny
    drafter, and a tiny drafter that has learned the first continuation (TTT on it, so its drafts get accepted)."""
    model, tokenizer = embedded_target
    random_drafter = tiny_drafter(model, learned["counts"])
    return model, tokenizer, learned["prompts"], learned["greedy"], random_drafter, learned["drafter"]


def check_sources(r, depth):
    """Each verify step reads: the accepted drafts 1..a, then the target's token; the first token is the prefill's."""
    src = r["source"]
    assert src[0] == replay.TARGET and len(src) == len(r["token_ids"]) == MAX_TOKENS
    expect = 0
    for s in src[1:]:
        assert s == (expect + 1 if s != replay.TARGET else replay.TARGET) and s <= depth
        expect = 0 if s == replay.TARGET else s


def test_greedy_reference_is_transformers_generate(setup):
    """generate stops at the end-of-turn token; the reference (like the benchmark, ignore_eos) goes on."""
    model, _, prompts, greedy, _, _ = setup
    for ids, want in zip(prompts, greedy):
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids) :].tolist()
        assert out == want[: len(out)] and len(out) >= 8


@pytest.mark.parametrize("depth", [1, 4])
def test_replay_is_lossless_with_any_drafter(setup, depth):
    model, _, prompts, greedy, random_drafter, learned = setup
    for drafter in (random_drafter, learned):
        for ids, want in zip(prompts, greedy):
            r = replay.speculative_decode(model, drafter, ids, depth, MAX_TOKENS)
            assert r["token_ids"] == want
            check_sources(r, depth)


def test_accepted_drafts_are_labelled_and_counted_as_engines_count(setup):
    model, _, prompts, greedy, random_drafter, learned = setup
    r = replay.speculative_decode(model, learned, prompts[0], 3, MAX_TOKENS)
    assert r["token_ids"] == greedy[0]
    assert r["accept_len"] > 2.0, r  # it learned this continuation
    assert max(r["source"]) == 3  # whole chains accepted
    # 1 + accepted / drafts; the per-position shares are joint (non-increasing) and add up to it
    assert r["accept_len"] == pytest.approx(1 + r["accepted"] / r["rounds"])
    assert r["accept_len"] == pytest.approx(1 + sum(r["per_pos"]))
    assert r["per_pos"] == sorted(r["per_pos"], reverse=True)
    labelled = sum(1 for s in r["source"] if s != replay.TARGET)
    assert labelled <= r["accepted"] and r["rounds"] >= r["source"].count(replay.TARGET) - 1
    # An untrained drafter proposes nothing the target takes.
    cold = replay.speculative_decode(model, random_drafter, prompts[0], 3, MAX_TOKENS)
    assert cold["accept_len"] < 1.2 and cold["rounds"] >= MAX_TOKENS * 0.8


def test_token_pieces_rebuild_the_text(embedded_target):
    _, tokenizer = embedded_target
    ids = tokenizer("Café déjà vu: 日本語 and emoji 🙂 done.\nNext line", add_special_tokens=False).input_ids
    pieces = replay.token_pieces(tokenizer, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == tokenizer.decode(ids)


def test_replay_prompts_pools_the_prompts_and_compares_with_the_baseline(setup, tmp_path):
    model, tokenizer, prompts, greedy, _, learned = setup
    recs = [{"id": f"p{i}", "prompt_ids": ids} for i, ids in enumerate(prompts)]
    baseline = [
        {"id": "p0", "token_ids": greedy[0], "text": tokenizer.decode(greedy[0])},
        {"id": "p1", "token_ids": greedy[1][:-1] + [greedy[1][-1] + 1], "text": "changed"},
    ]
    prov = replay.replay_prompts(
        model, tokenizer, learned, recs, [2, 3], MAX_TOKENS, baseline=baseline, texts={"p0": "days"}, progress=False
    )
    assert [p["prompt"] for p in prov["prompts"]][0] == "days" and prov["target_dtype"] == "float32"
    for d in ("2", "3"):
        rs = [p["replays"][d] for p in prov["prompts"]]
        s = prov["summary"][d]
        assert s["equals_baseline"] == 1 and [r["equals_baseline"] for r in rs] == [True, False]
        assert s["accept_len"] == pytest.approx(1 + sum(r["accepted"] for r in rs) / sum(r["rounds"] for r in rs))
        assert "".join(rs[0]["pieces"]) == tokenizer.decode(greedy[0])
    rows = [
        {"depth": 3, "concurrency": 4, "accept_len": 9.0, "per_pos": [0.1]},
        {"depth": 3, "concurrency": 1, "accept_len": 2.5, "per_pos": [0.9, 0.5, 0.2], "predicted_accept_len": 2.4},
    ]
    table = replay.compare_with_engine(prov, rows)
    assert [t["depth"] for t in table] == [2, 3] and table[0]["engine accept len"] is None
    assert table[1]["engine accept len"] == 2.5 and table[1]["engine concurrency"] == 1
    assert table[1]["equal to the baseline"] == "1 of 2"
    path = replay.save(tmp_path / "provenance.json", prov)
    assert replay.load(path) == prov
    with pytest.raises(FileNotFoundError, match="rerun the benchmark stage"):
        replay.load(tmp_path / "none.json")


def test_replay_dtype():
    assert replay.replay_dtype("float32", "bfloat16", "cuda") == "float32"
    assert replay.replay_dtype(None, "bfloat16", "cpu") == "float32"
    assert replay.replay_dtype(None, "bfloat16", "cuda:0") == "bfloat16"
