"""Training checkpoints on disk: what a kill -9 in the middle of a write leaves, and which run a checkpoint
may resume (eagle3lib/train/runtime/checkpoint.py)."""

import json
import shutil

import pytest
import torch

from eagle3lib.convert import layouts
from eagle3lib.drafter import Drafter, DrafterConfig
from eagle3lib.drafter.digests import DIGESTS_FILE, DamagedFolderError
from eagle3lib.train.runtime.checkpoint import (
    OPTIMIZER_FILE,
    SET_ASIDE,
    STATE_FILE,
    CheckpointError,
    checkpoints,
    latest_checkpoint,
    load_drafter,
    resume,
    save_checkpoint,
    save_drafter,
)

KEY = {"train": {"lr": 0.001, "draft_vocab_size": 100}, "run": {"seed": 0}, "inputs": {"train_tokens_sha256": "ab"}}


def tiny_drafter(seed: int) -> Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        vocab_size=300,
        draft_vocab_size=100,
        target_hidden_size=24,
        aux_layer_ids=[1, 2, 3],
    )
    return Drafter(cfg)


def trained_steps(root, steps, key=KEY):
    """A drafter and its AdamW after real steps, checkpointed at each step of `steps` under root."""
    drafter = tiny_drafter(0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    for step in steps:
        opt.zero_grad()
        sum(p.float().pow(2).sum() for p in drafter.parameters()).backward()
        opt.step()
        state = {"step": step, "epoch": 0, "micro_in_epoch": step, "tokens": 10 * step, "train_seconds": 1.0}
        save_checkpoint(drafter, opt, state | {"run_key": key}, root, {"contract": True})
    return drafter, opt


def fresh_pair():
    drafter = tiny_drafter(1)
    return drafter, torch.optim.AdamW(drafter.parameters(), lr=1e-3)


def test_leftovers_of_a_killed_write_are_neither_resumed_nor_kept(tmp_path):
    root = tmp_path / "checkpoints"
    trained, _ = trained_steps(root, [4, 8])
    # What a kill leaves: the temp folder of the next save before its optimizer.pt was written, the .old of
    # a rename pair, and a step folder without its state file.
    cut = root / "step_0000012.tmp"
    shutil.copytree(root / "step_0000008", cut)
    (cut / OPTIMIZER_FILE).unlink()
    shutil.copytree(root / "step_0000008", root / "step_0000010.old")
    shutil.copytree(root / "step_0000008", root / "step_0000011")
    (root / "step_0000011" / STATE_FILE).unlink()
    assert latest_checkpoint(root) == root / "step_0000008"
    drafter, opt = fresh_pair()
    log = []
    state = resume(drafter, opt, root, tmp_path / "log.jsonl", "cpu", KEY, log=log.append)
    assert state["step"] == 8 and "resumed from" in log[-1]
    assert all(torch.equal(v, trained.state_dict()[k]) for k, v in drafter.state_dict().items())
    assert opt.state_dict()["state"][0]["step"] == 2  # AdamW's own step count came back too
    trained_steps(root, [12])  # the next save keeps the last two whole checkpoints and nothing else
    assert sorted(p.name for p in root.iterdir()) == ["step_0000008", "step_0000012"]
    assert checkpoints(root) == [root / "step_0000008", root / "step_0000012"]


def test_a_write_cut_short_leaves_no_state_file(tmp_path, monkeypatch):
    """The state file is written last, so a folder that holds it holds everything: a save that dies while
    writing the optimizer (as a kill would) leaves a temp folder without the state, and the last whole
    checkpoint stays the latest."""
    root = tmp_path / "checkpoints"
    drafter, opt = trained_steps(root, [4])

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing optimizer.pt")

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(drafter, opt, {"step": 8, "run_key": KEY}, root, {"contract": True})
    cut = root / "step_0000008.tmp"
    assert cut.is_dir() and not (cut / STATE_FILE).exists()
    assert latest_checkpoint(root) == root / "step_0000004"


@pytest.mark.parametrize(
    "changed, says",
    [
        ({"train": {"lr": 0.0031, "draft_vocab_size": 100}}, "train.lr: 0.001 -> 0.0031"),
        ({"train": {"lr": 0.001, "draft_vocab_size": 64}}, "train.draft_vocab_size: 100 -> 64"),
        ({"inputs": {"train_tokens_sha256": "cd"}}, "inputs.train_tokens_sha256: 'ab' -> 'cd'"),
        ({"run": {"seed": 1}}, "run.seed: 0 -> 1"),
    ],
)
def test_a_checkpoint_of_other_params_is_set_aside_not_resumed(tmp_path, changed, says):
    root = tmp_path / "checkpoints"
    log_path = tmp_path / "log.jsonl"
    log_path.write_text(json.dumps({"step": 4, "loss": 1.0}) + "\n")
    trained_steps(root, [4])
    drafter, opt = fresh_pair()
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    log = []
    state = resume(drafter, opt, root, log_path, "cpu", KEY | changed, log=log.append)
    assert state["step"] == 0 and state["run_key"] == KEY | changed
    assert says in log[-1] and "not resuming" in log[-1]
    assert all(torch.equal(v, before[k]) for k, v in drafter.state_dict().items())
    aside = tmp_path / SET_ASIDE
    assert not root.exists() and not log_path.exists()
    assert (aside / "step_0000004" / STATE_FILE).is_file() and (aside / "log.jsonl").is_file()


def test_a_checkpoint_without_params_is_not_resumed(tmp_path):
    """Checkpoints written before the run key existed say nothing of their params: start fresh."""
    root = tmp_path / "checkpoints"
    trained_steps(root, [4], key=None)
    drafter, opt = fresh_pair()
    log = []
    assert resume(drafter, opt, root, tmp_path / "log.jsonl", "cpu", KEY, log=log.append)["step"] == 0
    assert "records no params" in log[-1]


def flip_byte(path, from_end=100):
    data = bytearray(path.read_bytes())
    data[-from_end] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage_it",
    [
        lambda c: flip_byte(c / "model.safetensors"),  # in the weights: it would load, silently other weights
        lambda c: (c / OPTIMIZER_FILE).write_bytes((c / OPTIMIZER_FILE).read_bytes()[:200]),  # torn
        lambda c: (c / "config.json").unlink(),
    ],
    ids=["flipped-weight", "torn-optimizer", "missing-config"],
)
def test_a_damaged_latest_checkpoint_resumes_the_previous_one_and_says_which_file(tmp_path, damage_it):
    root = tmp_path / "checkpoints"
    trained_steps(root, [1, 2])
    older, latest = checkpoints(root)
    expected = load_drafter(older)
    damage_it(latest)
    drafter, opt = fresh_pair()
    said = []
    state = resume(drafter, opt, root, tmp_path / "log.jsonl", "cpu", KEY, log=said.append)
    assert state["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), expected.state_dict().values()))
    told = " ".join(said)
    assert f"not resuming {latest.name}" in told and state["step"] == 1


def test_a_checkpoint_without_digests_that_does_not_load_is_passed_over(tmp_path):
    """A checkpoint written before sha256.json: a torn optimizer.pt is named, the older one resumed."""
    root = tmp_path / "checkpoints"
    trained_steps(root, [1, 2])
    older, latest = checkpoints(root)
    for c in (older, latest):
        (c / DIGESTS_FILE).unlink()
    (latest / OPTIMIZER_FILE).write_bytes(b"PK\x03\x04torn")
    said = []
    assert resume(*fresh_pair(), root, tmp_path / "log.jsonl", "cpu", KEY, log=said.append)["step"] == 1
    assert "does not load" in " ".join(said) and latest.name in " ".join(said)


def test_no_good_checkpoint_is_refused_naming_each_file(tmp_path):
    root = tmp_path / "checkpoints"
    trained_steps(root, [1, 2])
    for c in checkpoints(root):
        flip_byte(c / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"step_0000002/model.safetensors.*step_0000001/model.safetensors"):
        resume(*fresh_pair(), root, tmp_path / "log.jsonl", "cpu", KEY, log=lambda m: None)
    assert len(checkpoints(root)) == 2  # nothing removed: the user decides


def test_a_torn_log_line_is_dropped_with_a_note(tmp_path):
    root, log_path = tmp_path / "checkpoints", tmp_path / "log.jsonl"
    trained_steps(root, [1, 2])
    log_path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    said = []
    assert resume(*fresh_pair(), root, log_path, "cpu", KEY, log=said.append)["step"] == 2
    assert log_path.read_text().splitlines() == ['{"step": 1, "loss": 2.0}', '{"step": 2, "loss": 1.5}']
    assert any("line 3 is torn" in m for m in said)


def test_the_final_drafter_is_checked_before_it_is_read(tmp_path):
    """03_convert (formats.to_canonical) and the benchmark (load_drafter) read 02_train/drafter: a changed byte is
    refused before anything is made from it."""
    folder = save_drafter(tiny_drafter(0), tmp_path / "drafter", {"contract": True})
    assert json.loads((folder / DIGESTS_FILE).read_text()).keys() == {"config.json", "eagle3.json", "model.safetensors"}
    load_drafter(folder)
    flip_byte(folder / "model.safetensors")
    with pytest.raises(DamagedFolderError, match="drafter/model.safetensors does not match its sha256"):
        load_drafter(folder)
    with pytest.raises(DamagedFolderError, match="drafter/model.safetensors does not match its sha256"):
        layouts.export(folder, "vllm", tmp_path / "vllm")  # 03_convert's read
    assert not (tmp_path / "vllm").exists()
