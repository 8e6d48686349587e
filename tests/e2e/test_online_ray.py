"""train.online_placement: ray on a local Ray cluster on the CPU: a capture actor and a trainer actor train the
drafter the capture thread trains, a rerun resumes from the checkpoint's position, and what cannot run says why."""

import json
import os
import signal
import subprocess
import sys
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
from test_train_processes import LAUNCH, wait_until_gone

from eagle3lib.params import ParamsError, load_params
from eagle3lib.train import TrainingError, sources
from eagle3lib.train.runtime import launch
from eagle3lib.train.runtime.checkpoint import STATE_FILE
from eagle3lib.train.sources import ray_actors, ray_link, ray_reaper
from eagle3lib.train.sources.base import CAPTURE_SUMMARY

# Ray goes into .ray-site, outside the workbook's environment (it is needed by this placement only).
RAY_SITE = Path(__file__).resolve().parents[2] / ".ray-site"
if RAY_SITE.is_dir() and str(RAY_SITE) not in sys.path:
    sys.path.append(str(RAY_SITE))
pytest.importorskip(
    "ray",
    reason="train.online_placement: ray needs ray: `make ray-site`, i.e. `.venv/bin/pip install --no-deps --target .ray-site "
    "'ray==2.60.0' 'msgpack>=1,<2' 'protobuf>=3.20.3'` (or pip install 'ray>=2.52')",
)


COMMON = {"source": "online", "max_tokens": 128 * 2 * 3, "checkpoint_every": 3, "eval_every": 100}


@pytest.fixture(scope="module")
def local_ray():
    """The local clusters the tests start, ended with the module."""
    import ray

    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def thread_run(small_target, tmp_path_factory):
    """The reference: the capture in a thread of the one training process, on one thread (OMP_NUM_THREADS=1)."""
    root = tmp_path_factory.mktemp("thread")
    run = make_run(root, *small_target, COMMON | {"grad_accum": 2})
    subprocess.run(
        [sys.executable, "-m", "eagle3lib.train.runtime.launch", params_file(root), str(run)],
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        check=True,
        capture_output=True,
    )
    return run


def test_ray_actors_train_what_the_thread_does_and_resume_from_the_checkpoint(
    tmp_path,
    small_target,
    thread_run,
    local_ray,
):
    """The capture actor's micro-batches reach the trainer actor through the object store unchanged: the drafter is
    the capture thread's, byte for byte (each actor gets one core, so Ray runs its torch on one thread, as the
    thread run here; the sums run in the same order). A rerun with a larger budget captures from the checkpoint's
    position on. The cluster is the one launch starts on this host (its cores)."""
    run = make_run(tmp_path, *small_target, COMMON | {"grad_accum": 2, "online_placement": "ray"})
    s = launch.launch(load_params(params_file(tmp_path)), str(run))
    assert s["world_size"] == 1 and s["steps"] == 3
    assert_capture_summary_and_drafter_as(run, s, thread_run)

    s = launch.launch(load_params(params_file(tmp_path), {"train.max_tokens": 128 * 2 * 6}), str(run))
    capture = json.loads((run / "02_train" / CAPTURE_SUMMARY).read_text())
    checkpoint = json.loads((run / "02_train" / "checkpoints" / "step_0000003" / STATE_FILE).read_text())
    assert capture["started_at"] == {"epoch": checkpoint["epoch"], "sequence": checkpoint["sequence_in_epoch"]}
    assert s["steps"] == 6 and capture["started_at"]["sequence"] > 0

    cores = int(local_ray.cluster_resources()["CPU"])
    with pytest.raises(TrainingError, match=f"needs {cores + 1} CPUs .* the Ray cluster has {cores}"):
        launch.launch(load_params(params_file(tmp_path), {"train.nproc_per_node": cores}), str(run))
    with pytest.raises(TrainingError, match="start the stage with launch.launch"):
        launch.run_stage(load_params(params_file(tmp_path)), str(run))
    with pytest.raises(ParamsError, match="train.ray_address only applies to train.online_placement: ray"):
        load_params(params_file(tmp_path), {"train.online_placement": "thread", "train.ray_address": "h:1"})


def test_a_killed_ray_stage_leaves_no_ray_process_and_resumes_to_the_uninterrupted_drafter(tmp_path, small_target):
    """kill -9 of the process that runs the stage (the Ray driver, which started the local cluster) once a checkpoint
    is written: no process of its cluster is left (Ray's agents outlived their driver before ray_reaper.py), and
    the stage run again resumes from the checkpoint to the drafter the capture thread trains uninterrupted, byte for
    byte."""
    longer = COMMON | {"grad_accum": 2, "max_tokens": 128 * 2 * 6}
    ref = make_run(tmp_path / "thread", *small_target, longer)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    launch_ref = [sys.executable, "-m", "eagle3lib.train.runtime.launch", params_file(tmp_path / "thread"), str(ref)]
    subprocess.run(launch_ref, env=env, check=True, capture_output=True)
    run = make_run(tmp_path / "ray", *small_target, longer | {"online_placement": "ray"})
    path = os.pathsep.join(filter(None, [str(RAY_SITE), os.environ.get("PYTHONPATH")]))
    before = set(Path("/tmp").glob("eagle3-ray-*"))  # the Ray temp dirs start_local makes, one a cluster
    driver = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, params_file(tmp_path / "ray"), str(run)],
        env=os.environ | {"PYTHONPATH": path},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    first = run / "02_train" / "checkpoints" / "step_0000003" / STATE_FILE
    deadline = time.time() + 240
    while not first.exists() and time.time() < deadline and driver.poll() is None:
        time.sleep(0.05)
    (folder,) = set(Path("/tmp").glob("eagle3-ray-*")) - before
    assert len(ray_reaper.holding(folder)) >= 5, (
        "the cluster's processes (GCS, raylet, agents, actors) hold files there"
    )
    driver.send_signal(signal.SIGKILL)
    assert driver.wait() == -signal.SIGKILL, "training finished before it could be killed"
    deadline = time.time() + 40
    while ray_reaper.holding(folder) and time.time() < deadline:
        time.sleep(0.2)
    assert ray_reaper.holding(folder) == [], "a process of the killed stage's Ray cluster outlived it"
    assert not (run / "02_train" / "drafter").exists()

    s = launch.launch(load_params(params_file(tmp_path / "ray")), str(run))
    capture = json.loads((run / "02_train" / CAPTURE_SUMMARY).read_text())
    assert s["steps"] == 6 and capture["started_at"]["sequence"] > 0
    a, b = state(ref / "02_train" / "drafter"), state(run / "02_train" / "drafter")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_two_ray_trainers_sum_their_gradients_as_one_trainer_does(
    tmp_path,
    small_target,
    thread_run,
    local_ray,
):
    """Two trainer actors, a gloo group among them (its rendezvous on the first one's node): the global batch of one
    trainer with grad_accum 2, to float rounding (the sums run in another order). A cluster of 3 logical CPUs on
    this host, as the process placement's test runs 3 processes on 2 cores."""
    local_ray.shutdown()
    ray_actors.start_local(local_ray, ray_actors.LOCAL_STORE_MIN, num_cpus=3)
    run = make_run(tmp_path, *small_target, COMMON | {"online_placement": "ray"})
    s = launch.launch(load_params(params_file(tmp_path), {"train.nproc_per_node": 2}), str(run))
    assert s["world_size"] == 2 and len(set(s["rank_weight_digests"])) == 1 and s["steps"] == 3
    a, b = state(thread_run / "02_train" / "checkpoints" / "step_0000003"), state(run / "02_train" / "drafter")
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=1e-5, rtol=0), k


def test_without_ray_the_placement_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: its import fails
    with pytest.raises(TrainingError, match=r"pip install 'ray>=2.52'"):
        ray_link.import_ray()


def interpreter(path: Path, marker: Path, *flags: str) -> str:
    """A stand-in for SGLang's interpreter: this Python (with flags), each start written to marker."""
    path.write_text(f'#!/bin/sh\necho "$@" >> {marker}\nexec {sys.executable} {" ".join(flags)} "$@"\n')
    path.chmod(0o755)
    return str(path)


def test_sglang_inprocess_capture_actor_starts_in_sglangs_interpreter_and_fails_with_its_error(
    tmp_path,
    small_target,
    local_ray,
):
    """extract.backend sglang_inprocess with online_placement: ray: Ray starts the capture actor's worker with
    engine.python (py_executable; engine.env and this eagle3lib on its path), the trainer actor in this
    interpreter. One without sglang fails in the actor's load: that error reaches the driver as raised and no actor
    is left. One that cannot import this Ray is refused before a cluster or actor starts, saying how to install it.
    (SGLang's capture itself runs on GPU hosts only.)"""
    run = make_run(tmp_path, *small_target, COMMON | {"online_placement": "ray"})
    marker = tmp_path / "started.txt"
    over = {
        "extract.backend": "sglang_inprocess",
        "engine.name": "sglang",
        "engine.python": interpreter(tmp_path / "sglang-python", marker),
        "engine.env": {"PYTHONPATH": str(RAY_SITE)},  # Ray there: here it lives outside the environment
    }
    p = load_params(params_file(tmp_path), over)
    assert type(sources.for_params(p)) is ray_actors.InEngineRay
    with pytest.raises(ModuleNotFoundError, match=r"this interpreter \(.*\) has no sglang"):
        launch.launch(p, str(run))
    starts = marker.read_text().splitlines()
    assert any("default_worker.py" in line for line in starts), starts  # Ray's worker, started by engine.python
    assert wait_until_gone("ray::CaptureActor") == [] and wait_until_gone("ray::TrainerActor") == []
    assert not (run / "02_train" / "drafter").exists()

    no_ray = over | {"engine.python": interpreter(tmp_path / "bare-python", marker, "-S"), "engine.env": {}}
    local_ray.shutdown()
    with pytest.raises(TrainingError, match=r"(?s)needs this Ray \(2\.\d+.*No module named 'ray'.*pip install 'ray=="):
        launch.launch(load_params(params_file(tmp_path), no_ray), str(run))
    with pytest.raises(TrainingError, match=r"(?s)interpreter \(/nowhere/python\).*FileNotFoundError"):
        launch.launch(load_params(params_file(tmp_path), over | {"engine.python": "/nowhere/python"}), str(run))
    assert not local_ray.is_initialized()
