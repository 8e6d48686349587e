"""Training in processes of its own, on the small random Llama target of test_train: kill -9 then resume ends as an
uninterrupted run (shards, online, online with a capture process), torchrun's two processes equal one with the same
global batch, a capture process linked to the trainers by groups of its own trains what the capture thread does, and
the stage (or its capture process) in an engine's interpreter fails with its log."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from test_train import (
    assert_capture_summary_and_drafter_as,
    make_run,
    params_file,
    state,
)

from eagle3lib.params import ParamsError, load_params
from eagle3lib.train import TrainingError
from eagle3lib.train.runtime import launch
from eagle3lib.train.runtime.checkpoint import STATE_FILE, latest_checkpoint
from eagle3lib.train.sources.base import CAPTURE_SUMMARY

# The stage as the 02_train notebook starts it (its placement's processes), in a process that can be killed
LAUNCH = (
    "import sys; from eagle3lib.params import load_params; from eagle3lib.train.runtime import launch; "
    "launch.launch(load_params(sys.argv[1]), sys.argv[2])"
)


def kill_after_checkpoint(params: str, run_dir, step_dir: str, entry=("-m", "eagle3lib.train.runtime.launch")):
    """Train in a subprocess (`python *entry params run_dir`) and SIGKILL it once checkpoints/<step_dir> is written;
    returns the checkpoints folder."""
    log = Path(params).with_name("killed_run.log")  # a file, not a pipe: a full pipe would stall the trainer
    proc = subprocess.Popen(
        [sys.executable, *entry, params, str(run_dir)],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )
    ckpt = run_dir / "02_train" / "checkpoints"
    deadline = time.time() + 120
    while not (ckpt / step_dir / STATE_FILE).exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ended = f"training ended (rc {proc.returncode}) before it could be killed: {log.read_text()[-3000:]}"
    assert proc.returncode == -signal.SIGKILL, ended
    return ckpt


def processes_naming(text: str) -> list[int]:
    """Pids of the running processes whose command line holds text (a zombie's is empty)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and text.encode() in (d / "cmdline").read_bytes():
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


def wait_until_gone(text: str, timeout_s: float = 40) -> list[int]:
    """Waits for the processes naming text to end; returns those still running after timeout_s."""
    deadline = time.time() + timeout_s
    while processes_naming(text) and time.time() < deadline:
        time.sleep(0.2)
    return processes_naming(text)


def test_resume_after_kill_ends_where_an_uninterrupted_run_does(tmp_path, small_target):
    slow = {"batch_rows": 4, "max_seq_len": 256, "max_tokens": 1024 * 16, "checkpoint_every": 4, "eval_every": 100}
    ref_dir = make_run(tmp_path / "ref", *small_target, slow)
    launch.run_stage(load_params(params_file(tmp_path / "ref")), str(ref_dir))
    run_dir = make_run(tmp_path / "killed", *small_target, slow)
    kill_after_checkpoint(params_file(tmp_path / "killed"), run_dir, "step_0000004")
    assert not (run_dir / "02_train" / "drafter").exists()
    summary = launch.run_stage(load_params(params_file(tmp_path / "killed")), str(run_dir))
    assert summary["steps"] == 16
    ref, resumed = state(ref_dir / "02_train" / "drafter"), state(run_dir / "02_train" / "drafter")
    for k in ref:
        assert torch.allclose(ref[k].float(), resumed[k].float(), atol=1e-6, rtol=0), k
    entries = [json.loads(line) for line in (run_dir / "02_train" / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in entries if "eval" not in e] == list(range(1, 17))


def test_online_run_killed_resumes_where_it_stood_and_ends_as_an_uninterrupted_one(tmp_path, small_target):
    """kill -9 in the middle of an online run, then a rerun: it resumes from the last checkpoint, captures from that
    checkpoint's position on (nothing before it again) and ends with the uninterrupted run's drafter."""
    slow = {"source": "online", "batch_rows": 4, "max_seq_len": 256, "max_tokens": 1024 * 12, "checkpoint_every": 4}
    slow |= {"eval_every": 100}
    ref_dir = make_run(tmp_path / "ref", *small_target, slow)
    ref = launch.run_stage(load_params(params_file(tmp_path / "ref")), str(ref_dir))
    run_dir = make_run(tmp_path / "killed", *small_target, slow)
    ckpt = kill_after_checkpoint(params_file(tmp_path / "killed"), run_dir, "step_0000004")
    at = json.loads((latest_checkpoint(ckpt) / STATE_FILE).read_text())
    summary = launch.run_stage(load_params(params_file(tmp_path / "killed")), str(run_dir))
    assert summary["steps"] == ref["steps"] == 12 and summary["tokens"] == ref["tokens"]
    assert summary["online"]["started_at"] == {"epoch": at["epoch"], "sequence": at["sequence_in_epoch"]}
    assert at["step"] >= 4 and (at["epoch"], at["sequence_in_epoch"]) > (0, 0)
    a, b = state(ref_dir / "02_train" / "drafter"), state(run_dir / "02_train" / "drafter")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def capture_process_of(run_dir) -> int | None:
    """The pid of the stage's capture process (its launcher marked it in its environment; not its guard)."""
    from eagle3lib.train.sources.capture_link import CAPTURE, ROLE_ENV

    for pid in processes_naming(str(run_dir)):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            marked = f"{ROLE_ENV}={CAPTURE}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marked and b"guard.py" not in cmdline:
            return pid
    return None


def test_a_capture_process_killed_ends_the_stage_at_once_naming_it(tmp_path, small_target):
    """kill -9 of the capture process alone, mid-run: the trainer does not wait for batches that never come, the
    stage fails at once saying the capture process died, and nothing of the stage is left running."""
    slow = {"source": "online", "batch_rows": 4, "max_seq_len": 256, "max_tokens": 1024 * 8, "checkpoint_every": 3}
    run_dir = make_run(tmp_path, *small_target, slow | {"eval_every": 100, "online_placement": "process"})
    p, failed = load_params(params_file(tmp_path)), []

    def run():
        try:
            launch.launch(p, str(run_dir))
        except Exception as e:
            failed.append(e)

    stage = threading.Thread(target=run)
    stage.start()
    deadline = time.time() + 120
    step = run_dir / "02_train" / "checkpoints" / "step_0000003" / STATE_FILE
    while not step.exists() and stage.is_alive() and time.time() < deadline:
        time.sleep(0.01)
    capture = capture_process_of(run_dir)
    assert capture is not None and step.exists(), "the stage ended before its capture process could be killed"
    os.kill(capture, signal.SIGKILL)
    stage.join(60)
    assert not stage.is_alive() and failed, "the stage did not end when its capture process died"
    assert isinstance(failed[0], TrainingError) and "the capture process exited -9" in str(failed[0])
    assert not (run_dir / "02_train" / "drafter").exists()
    assert wait_until_gone(str(run_dir)) == []


def test_torchrun_two_processes_equal_one_with_the_same_global_batch(tmp_path, small_target):
    common = {"max_tokens": 128 * 2 * 3, "checkpoint_every": 100, "eval_every": 100, "warmup_steps": 1}
    single = make_run(tmp_path / "single", *small_target, common | {"grad_accum": 2})
    # torchrun gives each rank one thread; the reference gets one too, so float sums run in the same order.
    subprocess.run(
        [sys.executable, "-m", "eagle3lib.train.runtime.launch", params_file(tmp_path / "single"), str(single)],
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        check=True,
        capture_output=True,
    )
    s1 = json.loads((single / "02_train" / "train_summary.json").read_text())
    ddp = make_run(tmp_path / "ddp", *small_target, common | {"grad_accum": 1})
    s2 = launch.launch(load_params(params_file(tmp_path / "ddp"), {"train.nproc_per_node": 2}), str(ddp))
    assert s2["world_size"] == 2 and len(s2["rank_weight_digests"]) == 2
    assert len(set(s2["rank_weight_digests"])) == 1, "ranks diverged"
    assert s1["steps"] == s2["steps"] == 3 and s1["tokens"] == s2["tokens"]
    a, b = state(single / "02_train" / "drafter"), state(ddp / "02_train" / "drafter")
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=1e-5, rtol=0), k
    # Resume under torchrun: both runs continue to 6 steps from their final checkpoint (a larger max_tokens
    # continues a run); the two ranks load the checkpoint and the data position, and still equal one process.
    more = {"train.max_tokens": 128 * 2 * 6}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3lib.train.runtime.launch",
            params_file(tmp_path / "single"),
            str(single),
            json.dumps(more),
        ],
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        check=True,
        capture_output=True,
    )
    s2 = launch.launch(load_params(params_file(tmp_path / "ddp"), more | {"train.nproc_per_node": 2}), str(ddp))
    s1 = json.loads((single / "02_train" / "train_summary.json").read_text())
    assert s1["steps"] == s2["steps"] == 6 and len(set(s2["rank_weight_digests"])) == 1
    log = [json.loads(line) for line in (ddp / "02_train" / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log if "eval" not in e] == list(range(1, 7))  # steps 4-6 appended, none redone
    a, b = state(single / "02_train" / "drafter"), state(ddp / "02_train" / "drafter")
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=1e-5, rtol=0), k


def test_torchrun_ranks_under_a_time_budget_take_one_schedule_and_stop_together(tmp_path, small_target):
    """Each rank has its own clock: the schedule sized to the minutes is rank 0's for both, and the clock's stop is
    agreed each step, so the two leave the loop on the same step with the same weights (not one rank waiting in a
    collective the other never joins)."""
    budget = {"max_tokens": 128 * 2 * 100_000, "max_minutes": 0.1, "checkpoint_every": 50, "eval_every": 50}
    run_dir = make_run(tmp_path, *small_target, budget | {"warmup_steps": 1})
    s = launch.launch(load_params(params_file(tmp_path), {"train.nproc_per_node": 2}), str(run_dir))
    assert s["world_size"] == 2 and len(set(s["rank_weight_digests"])) == 1
    assert "train.max_minutes" in s["schedule"]["why"] and s["steps"] <= s["total_steps"] < 100_000


def thread_reference(root, small_target, train_params: dict):
    """The capture thread's run, in a process with one thread (as each process of the process placement has, so
    the float sums run in the same order); returns its run folder."""
    run = make_run(root, *small_target, train_params)
    subprocess.run(
        [sys.executable, "-m", "eagle3lib.train.runtime.launch", params_file(root), str(run)],
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        check=True,
        capture_output=True,
    )
    return run


def test_online_capture_process_links_by_groups_of_its_own_and_trains_what_the_thread_does(tmp_path, small_target):
    """online_placement: process: the capture process sends micro-batches through gloo groups made for the link to
    the trainers, which train the drafter the capture thread trains, and a resume continues from the checkpoint's
    position; started again once finished, it ends at once. The trainers' default group is theirs alone: none for one trainer, two trainers' of size 2 (the
    global batch of one); the capture process joins none (SGLang's ranks may own it)."""
    common = {"source": "online", "max_tokens": 128 * 2 * 3, "checkpoint_every": 3, "eval_every": 100}
    thread = thread_reference(tmp_path / "thread", small_target, common | {"grad_accum": 2})
    process = make_run(tmp_path / "process", *small_target, common | {"grad_accum": 2, "online_placement": "process"})
    s = launch.launch(load_params(params_file(tmp_path / "process")), str(process))
    assert s["world_size"] == 1 and s["steps"] == 3 and s["default_group"] is None
    assert_capture_summary_and_drafter_as(process, s, thread)
    assert json.loads((process / "02_train" / CAPTURE_SUMMARY).read_text())["default_group"] is None
    # started again when finished: the trainers have no step left and tell the capture process so; nothing hangs
    s = launch.launch(load_params(params_file(tmp_path / "process")), str(process))
    assert s["steps"] == 3 and json.loads((process / "02_train" / CAPTURE_SUMMARY).read_text())["tokens"] == 0
    more = {"train.max_tokens": 128 * 2 * 6}
    s = launch.launch(load_params(params_file(tmp_path / "process"), more), str(process))
    capture = json.loads((process / "02_train" / CAPTURE_SUMMARY).read_text())
    checkpoint = json.loads((process / "02_train" / "checkpoints" / "step_0000003" / STATE_FILE).read_text())
    assert capture["started_at"] == {"epoch": checkpoint["epoch"], "sequence": checkpoint["sequence_in_epoch"]}
    assert s["steps"] == 6 and capture["started_at"]["sequence"] > 0
    two = make_run(tmp_path / "two", *small_target, common | {"online_placement": "process"})
    s = launch.launch(load_params(params_file(tmp_path / "two"), {"train.nproc_per_node": 2}), str(two))
    assert s["world_size"] == 2 and len(set(s["rank_weight_digests"])) == 1 and s["steps"] == 3
    assert s["default_group"] == {"backend": "gloo", "size": 2}  # the two trainers, not the capture process
    assert json.loads((two / "02_train" / CAPTURE_SUMMARY).read_text())["default_group"] is None
    b = state(two / "02_train" / "drafter")
    a = state(thread / "02_train" / "checkpoints" / "step_0000003")
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=1e-5, rtol=0), k


def test_online_capture_process_run_killed_resumes_and_ends_as_an_uninterrupted_one(tmp_path, small_target):
    """kill -9 of a run with a capture process (the stage's launcher, as a dead kernel leaves it): the guards end
    the capture process and the trainer, a rerun resumes from the last checkpoint, captures from its position on and
    ends with the uninterrupted thread run's drafter (to float rounding)."""
    slow = {"source": "online", "batch_rows": 4, "max_seq_len": 256, "max_tokens": 1024 * 8, "checkpoint_every": 3}
    slow |= {"eval_every": 100}
    ref = thread_reference(tmp_path / "ref", small_target, slow)
    run_dir = make_run(tmp_path / "killed", *small_target, slow | {"online_placement": "process"})
    ckpt = kill_after_checkpoint(params_file(tmp_path / "killed"), run_dir, "step_0000003", entry=("-c", LAUNCH))
    assert wait_until_gone(str(run_dir)) == [], "a process of the killed stage outlived it"
    at = json.loads((latest_checkpoint(ckpt) / STATE_FILE).read_text())
    assert not (run_dir / "02_train" / "drafter").exists() and at["step"] in (3, 6)
    s = launch.launch(load_params(params_file(tmp_path / "killed")), str(run_dir))
    capture = json.loads((run_dir / "02_train" / CAPTURE_SUMMARY).read_text())
    assert s["steps"] == 8 and capture["started_at"] == {"epoch": at["epoch"], "sequence": at["sequence_in_epoch"]}
    assert s["default_group"] is None and capture["default_group"] is None
    a, b = state(ref / "02_train" / "drafter"), state(run_dir / "02_train" / "drafter")
    for k in a:  # to rounding: the resumed trainer's sums may run in another order than the uninterrupted one's
        assert torch.allclose(a[k].float(), b[k].float(), atol=1e-5, rtol=0), (k, (a[k] - b[k]).abs().max())


def test_online_sglang_inprocess_trains_in_sglangs_interpreter_and_fails_with_its_log(tmp_path, small_target):
    """launch.launch starts the stage in engine.python; an interpreter without sglang fails there, and the
    error brings the reason and the log. The backends that serve states over HTTP, and several trainers in the
    thread placement, are refused when the params load."""
    run_dir = make_run(tmp_path, *small_target, {"source": "online"})
    over = {"extract.backend": "sglang_inprocess", "engine.name": "sglang", "engine.python": sys.executable}
    with pytest.raises(TrainingError, match=r"(?s)exited 1.*has no sglang: start the stage with launch.launch"):
        launch.launch(load_params(params_file(tmp_path), over), str(run_dir))
    assert "ModuleNotFoundError" in (run_dir / "02_train" / "sglang-online.log").read_text()
    with pytest.raises(ParamsError, match="'vllm' serves states over HTTP and is not wired to online training"):
        load_params(params_file(tmp_path), {"extract.backend": "vllm"})
    with pytest.raises(ParamsError, match=r"set train.nproc_per_node: 1 \(not 2\), or train.online_placement: process"):
        load_params(params_file(tmp_path), {"extract.backend": "sglang_inprocess", "train.nproc_per_node": 2})


def test_online_sglang_inprocess_capture_process_runs_in_sglangs_interpreter_and_fails_with_its_log(
    tmp_path, small_target
):
    """online_placement: process with sglang_inprocess: the capture process is started in engine.python beside two
    trainers in this interpreter; one without sglang fails there, its error reaches the trainers and the stage's
    error brings the capture process's log. (SGLang's capture itself runs on GPU hosts only.)"""
    run_dir = make_run(tmp_path, *small_target, {"source": "online", "online_placement": "process"})
    over = {"extract.backend": "sglang_inprocess", "engine.name": "sglang", "engine.python": sys.executable}
    p = load_params(params_file(tmp_path), over | {"train.nproc_per_node": 2})
    with pytest.raises(TrainingError, match=r"(?s)capture process exited 1.*has no sglang: start the stage"):
        launch.launch(p, str(run_dir))
    assert "ModuleNotFoundError" in (run_dir / "02_train" / "capture.log").read_text()
    assert wait_until_gone(str(run_dir)) == []
