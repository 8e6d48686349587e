"""A disk that fills while something is written: the error names the file being written and says the disk is full,
the earlier whole file stays, no half-written file is left where a rerun would trust it, and after the space is
freed the same write succeeds. On a small tmpfs mounted for the test (root only: skipped elsewhere)."""

import errno
import os
from pathlib import Path

import pytest
import torch
from small_disk import fill, mount_tmpfs, unmount
from test_checkpoint import KEY, trained_steps

from eagle3lib import run_folder
from eagle3lib.extract.shards import ShardLayout, ShardWriter, load_manifest
from eagle3lib.train.runtime.checkpoint import checkpoints, save_checkpoint


@pytest.fixture
def small_disk(tmp_path):
    disk = mount_tmpfs(tmp_path / "disk", 8)
    yield disk
    unmount(disk)


def test_a_whole_file_or_the_earlier_one_and_the_error_names_it(small_disk):
    path = small_disk / "result.json"
    run_folder.write_json(path, {"before": True})
    filler = fill(small_disk)
    with pytest.raises(OSError) as raised:
        run_folder.write_json(path, {"after": "x" * 100_000})
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(path)
    assert run_folder.read_result(small_disk.parent, small_disk.name) == {"before": True}
    assert sorted(p.name for p in small_disk.iterdir()) == sorted([filler.name, "result.json"])  # no temp left
    filler.unlink()
    run_folder.write_json(path, {"after": 1})
    assert run_folder.read_result(small_disk.parent, small_disk.name) == {"after": 1}


def test_words_of_a_full_disk_name_the_file():
    text = "OSError: [Errno 28] No space left on device: '/runs/t/02_train/checkpoints/step_0000010/optimizer.pt'"
    said = run_folder.disk_full_text(text, Path("/"))
    assert said.startswith("the disk is full while writing /runs/t/02_train/checkpoints/step_0000010/optimizer.pt:")
    assert "df -h" in said and "run.output_root" in said
    assert run_folder.disk_full_text("ValueError: thirteen prompts are unlucky", Path("/")) is None
    torn = "SafetensorError: Error while serializing: I/O error: No space left on device (os error 28)"
    said = run_folder.disk_full_text(torn, Path("/runs/t/02_train"))
    assert said.startswith("the disk is full while writing in /runs/t/02_train:")


def tokens(n_seqs=12, length=40):
    g = torch.Generator().manual_seed(0)
    starts = torch.arange(n_seqs + 1, dtype=torch.int64) * length
    n = n_seqs * length
    return {
        "input_ids": torch.randint(0, 256, (n,), generator=g, dtype=torch.int32),
        "loss_mask": torch.ones(n, dtype=torch.uint8),
        "seq_starts": starts,
    }


def write_shards(out_dir, tok, hidden=64, aux=(1, 2, 3)):
    """Every missing shard of out_dir written with states that depend only on the token's place."""
    layout = ShardLayout(shard_max_tokens=80, store_dtype=torch.float32)
    contract = {"hidden_size": hidden, "aux_layer_ids": list(aux)}
    with ShardWriter(out_dir, tok, contract, layout, aux, hidden) as writer:
        for first, end in writer.missing():
            a, b = int(tok["seq_starts"][first]), int(tok["seq_starts"][end])
            rows = torch.arange(a, b, dtype=torch.float32)[:, None]
            writer.put(first, end, (rows.repeat(1, 3 * hidden), rows.repeat(1, hidden) + 0.5))
    writer.complete()
    return load_manifest(out_dir)


def test_a_shard_cut_short_names_its_file_and_the_rerun_ends_as_a_clean_one(small_disk, tmp_path):
    tok = tokens()  # 6 shards of ~83 kB
    clean = write_shards(str(tmp_path / "clean"), tok)
    out = small_disk / "train"
    os.makedirs(out)
    filler = fill(small_disk)
    os.truncate(filler, os.path.getsize(filler) - 200_000)  # room for two shards, not six
    with pytest.raises(OSError) as raised:
        write_shards(str(out), tok)
    assert raised.value.errno == errno.ENOSPC
    assert Path(raised.value.filename).parent == out and Path(raised.value.filename).name.startswith("shard_")
    listed = load_manifest(str(out))["shards"]
    assert 0 < len(listed) < len(clean["shards"]) and not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    filler.unlink()
    assert write_shards(str(out), tok)["shards"] == clean["shards"]  # same files, same sha256


def test_a_checkpoint_cut_short_names_its_file_and_keeps_the_last_whole_one(small_disk):
    root = small_disk / "checkpoints"
    drafter, opt = trained_steps(root, [4])
    filler = fill(small_disk)
    state = {"step": 8, "epoch": 0, "micro_in_epoch": 8, "tokens": 80, "train_seconds": 1.0, "run_key": KEY}
    with pytest.raises(OSError) as raised:
        save_checkpoint(drafter, opt, state, root, {"contract": True})
    assert raised.value.errno == errno.ENOSPC
    assert Path(raised.value.filename).parent == root / "step_0000008"  # the file in the folder it becomes
    assert checkpoints(root) == [root / "step_0000004"] and sorted(p.name for p in root.iterdir()) == ["step_0000004"]
    filler.unlink()
    save_checkpoint(drafter, opt, state, root, {"contract": True})
    assert checkpoints(root) == [root / "step_0000004", root / "step_0000008"]


def test_a_torn_notebook_is_not_what_the_error_says(tmp_path):
    """An executed notebook cut short (as a full disk left one before its saves were atomic) is not read as the
    stage's error: the error papermill raised is."""
    from eagle3lib.workbook.pipeline import notebook_error

    torn = tmp_path / "02_train.ipynb"
    torn.write_text('{\n "cells": [\n  {\n   "cell_type": "code",')
    full = OSError(errno.ENOSPC, "No space left on device", str(torn))
    assert notebook_error(torn, full) == f"OSError: [Errno 28] No space left on device: '{torn}'"
    assert notebook_error(torn, RuntimeError("kernel died")) == "RuntimeError: kernel died"
