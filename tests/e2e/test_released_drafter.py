"""The released drafter (drafters/smollm2-135m-instruct), which the CPU recipe starts from: its files are the
ones provenance.json records, it loads and fits the embedded target, and the conversations it saw, drawn again
here from the embedded data, are the recorded ones and none of params/smollm2-135m-cpu.yaml's val and bench."""

import hashlib
import json
from pathlib import Path

import pytest
import torch

from eagle3lib.params import ParamsError, load_params
from eagle3lib.prepare import conversations as D
from eagle3lib.prepare import notebook
from eagle3lib.prepare import sources as S
from eagle3lib.target import config as target_config
from eagle3lib.target import contract, loading
from eagle3lib.train.runtime.checkpoint import load_drafter

ROOT = Path(__file__).resolve().parents[2]
RELEASED = ROOT / "drafters" / "smollm2-135m-instruct"
PROVENANCE = json.loads((RELEASED / "provenance.json").read_text())


def test_shipped_files_are_the_recorded_ones():
    assert set(PROVENANCE["files"]) == {"config.json", "eagle3.json", "model.safetensors", "conversations.json"}
    for name, digest in PROVENANCE["files"].items():
        assert hashlib.sha256((RELEASED / name).read_bytes()).hexdigest() == digest, f"{name} differs from provenance"
    assert (RELEASED / "model.safetensors").stat().st_size < 16e6  # a few MB: bf16, draft vocabulary 2,048
    tiny = load_params(ROOT / "params" / "smollm2-135m-cpu.yaml")
    assert tiny.train.init_from == str(RELEASED)  # relative to the params file
    with pytest.raises(
        ParamsError, match=r"train.init_from: no drafter folder at .*drafters/nope \(paths are relative"
    ):
        load_params(ROOT / "params" / "smollm2-135m-cpu.yaml", {"train.init_from": "../drafters/nope"})


def test_released_drafter_loads_and_fits_the_embedded_target(tmp_path):
    drafter = load_drafter(RELEASED)
    contract_there = json.loads((RELEASED / "eagle3.json").read_text())
    target_dir = loading.embedded_target_dir(loading.default_cache_dir())
    assert contract_there["target_fingerprint"] == contract.target_fingerprint(target_config.load_config(target_dir))
    tiny = load_params(ROOT / "params" / "smollm2-135m-cpu.yaml")
    assert drafter.cfg.draft_vocab_size == tiny.train.draft_vocab_size
    assert drafter.cfg.aux_layer_ids == contract_there["aux_layer_ids"] == [2, 15, 27]
    assert all(torch.isfinite(p).all() for p in drafter.parameters())
    assert PROVENANCE["training"]["tokens_trained"] > 1e7
    assert PROVENANCE["served"]["accept_len_mean"]["3"] > 1.5  # SGLang on the H200, greedy, 4 sets


@pytest.mark.slow
def test_its_conversations_are_drawn_again_and_none_is_the_default_runs_val_or_bench():
    """The H200 read the embedded set's first 7,000 records from a file; drawing the release's splits again here
    from the embedded package gives the same ids, so they are the ones the drafter trained on, and neither those ids
    nor their user turns are any of params/smollm2-135m-cpu.yaml's val and bench conversations."""
    shipped = json.loads((RELEASED / "conversations.json").read_text())
    release = load_params(ROOT / "params" / "smollm2-135m-gpu-release.yaml")
    pool, stats = notebook.load_pool(release)
    split = D.split_conversations(pool, release.data.val_fraction, release.data.bench_count, release.run.seed)
    assert {k: [c["id"] for c in v] for k, v in split.items()} == shipped

    tiny = load_params(ROOT / "params" / "smollm2-135m-cpu.yaml")
    theirs, _ = S.load_conversations(tiny.data.sources, limit=tiny.data.max_conversations)
    tiny_split = D.split_conversations(theirs, tiny.data.val_fraction, tiny.data.bench_count, tiny.run.seed)
    held_out = tiny_split["val"] + tiny_split["bench"]
    seen = [c for part in split.values() for c in part]
    assert not {c["id"] for c in held_out} & {c["id"] for c in seen}
    assert not {t for c in held_out for t in D.user_texts(c)} & {t for c in seen for t in D.user_texts(c)}
    assert sum(stats["kept_unseen"].values()) > 0


def test_the_train_report_shows_the_released_drafter_before_and_after_the_fine_tune():
    from eagle3lib.train import notebook as train_notebook

    ev = lambda al: {"est_accept_len": {str(d): al + d / 100 for d in range(1, 17)}, "cond_acc": [0.5]}  # noqa: E731
    summary = {
        "initial_eval": ev(1.5), "eval": ev(1.7), "steps": 1, "tokens": 10, "train_tokens_per_s": 1.0,
        "vocab": {"warm_start": {"init_from": str(RELEASED), "layout": "ours"}},
    }  # fmt: skip
    text = train_notebook.fine_tune_text(summary)
    assert text.startswith(f"started from {RELEASED}") and "@3 1.53 -> 1.73" in text and "@16 1.66 -> 1.86" in text
    assert train_notebook.result(summary)["headline"]["est. accept len @5 before"] == 1.55
    assert "demonstration" not in text and "fine-tune" not in train_notebook.result(summary)["headline"]
    scratch = summary | {"vocab": {}}
    assert train_notebook.fine_tune_text(scratch).startswith("started untrained")
    assert "est. accept len @5 before" not in train_notebook.result(scratch)["headline"]
    # a CPU run: 3 minutes moved the released drafter's est. AL@5 from 2.0906 to 2.0976
    flat = summary | {"initial_eval": ev(2.0406), "eval": ev(2.0476), "tokens": 51_000}
    said = train_notebook.fine_tune_text(flat).splitlines()[-1]
    assert said.startswith("A demonstration of the stage: 51,000 tokens moved est. AL@5 by +0.3% (2.091 -> 2.098)")
    assert train_notebook.result(flat)["headline"]["fine-tune"] == "a demonstration (under +1% est. AL@5)"
    assert train_notebook.fine_tune_text(flat | {"vocab": {}}).count("\n") == 0  # from scratch: no verdict
