"""train.online_placement: ray. Ray places one capture actor (the target's device: a GPU on CUDA, a CPU core
otherwise) and train.nproc_per_node trainer actors (a GPU each on CUDA), on this host or on the hosts of a running
cluster (RAY_ADDRESS or train.ray_address); the micro-batches go through Ray's object store: shared memory on one
node, Ray's object transfer between nodes (docs/design.md §8, online mode).

The capture actor makes the micro-batches the process placement's serve_capture (sources/capture_link.py) makes
(online.capture_setup's producer, micro_batches from the first trainer's checkpoint position, the same order) and
hands micro-batch n to every trainer, its states only to the one that trains it (n % trainers, as TrainStep
shares a step's group). The queue
is a number of object refs: a trainer keeps train.online_queue_batches calls of `next_item` outstanding and adds
one each time it takes a micro-batch; the actor runs its calls in turn, so the capture runs that many ahead and
then waits, as the process placement's credits. A trainer that stops waits for its outstanding calls (what it had
granted) and the driver then ends the actors.

Several trainers sum their gradients over torch.distributed among themselves (gloo on the CPU, NCCL on GPUs),
MASTER_ADDR and MASTER_PORT taken on the first trainer's node, as Ray Train does; one trainer needs none.
Ray is not a dependency of the workbook: it is imported only here, when this placement runs.

With extract.backend sglang_inprocess (InEngineRay) the capture actor runs in SGLang's interpreter (Ray's
py_executable: engine.python, else .venv-sglang, which must have this Ray) and takes SGLang's --tp GPUs of one
node, its model runner's tensor-parallel ranks its own processes there; the trainers stay in this interpreter,
wherever Ray places them: a Kimi-sized target on one node's GPUs, its trainers on another's.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections import deque
from pathlib import Path

import torch

from eagle3lib.train import TrainingError, online
from eagle3lib.train.batches import micro_batches, pack_val_rows
from eagle3lib.train.sources.base import CAPTURE_SUMMARY, OnlinePlacement, StageProcess, StageRun
from eagle3lib.train.sources.process import engine_tp_gpus

RAY_MISSING = (
    "train.online_placement: ray needs Ray in this environment (and on every host of the cluster): "
    "pip install 'ray>=2.52' (tested with 2.60.0), or set train.online_placement: process (one host)"
)
PLACE_TIMEOUT_S = 120  # a cluster whose free resources fit the totals but no node takes an actor: say so, not hang
CLOSE_TIMEOUT_S = 120  # the capture's engine stopping (its ranks' processes ending) before its actor is killed
LOCAL_STORE_MIN = 128 * 2**20  # the local cluster's object store floor; Ray spills to disk past it (slower, same)


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise TrainingError(RAY_MISSING) from e
    return ray


# --------------------------------------------------------- the object store's form of a micro-batch ----


def to_store(mb: dict, with_states: bool) -> dict:
    """A micro-batch as Ray stores it: tensors as numpy arrays (kept without a copy in the object store, where
    torch tensors would be pickled), bfloat16 as its int16 bits (numpy has no bfloat16); without its states
    unless with_states."""
    out = {}
    for k, v in mb.items():
        if k in ("aux", "final", "aux_scale", "final_scale") and not with_states:
            continue
        if isinstance(v, torch.Tensor):
            v = v.detach().cpu().contiguous()
            v = ("bfloat16", v.view(torch.int16).numpy()) if v.dtype == torch.bfloat16 else ("", v.numpy())
        out[k] = v
    return out


def from_store(stored: dict) -> dict:
    """A micro-batch back from to_store: the store's arrays are read-only, so each tensor is copied once."""
    out = {}
    for k, v in stored.items():
        if isinstance(v, tuple):
            dtype, array = v
            v = torch.from_numpy(array.copy())
            v = v.view(torch.bfloat16) if dtype == "bfloat16" else v
        out[k] = v
    return out


# ------------------------------------------------------------------------------- the actors ----


def actor_overrides(p, overrides: dict | None) -> dict:
    """The params an actor loads: a Ray actor sees only the GPU it was given, as cuda:0."""
    overrides = dict(overrides or {})
    if p.target.device.startswith("cuda"):
        overrides["target.device"] = "cuda"
    return overrides


class CaptureActor:
    """The capture: loads the target on its device and serves the validation rows and the stream of micro-batches
    (made once, handed to every trainer, dropped when all took it)."""

    def __init__(self, params_file: str, run_dir: str, overrides: dict, trainers: int):
        from eagle3lib.params import load_params, stage_view

        self.p = stage_view(load_params(params_file, overrides), "02_train")
        self.run_dir, self.trainers = Path(run_dir), trainers
        self.train = self.val = None
        self.val_ref = self.stream = self.start = self.failed = None
        self.items, self.made, self.taken = {}, 0, [0] * trainers

    def ready(self) -> bool:
        return True

    def load(self) -> None:
        from eagle3lib.prepare import conversations

        prep = self.run_dir / "00_prepare"
        train_tokens = conversations.load_tokens(prep / "train.safetensors")
        val_tokens = conversations.load_tokens(prep / "val.safetensors")
        self.train, self.val, _ = online.capture_setup(self.p, train_tokens, val_tokens, self.run_dir / "02_train")

    def val_rows(self) -> list:
        """[ref] of the validation rows, put in the object store once for every trainer (a list: Ray hands an
        object ref inside a return value back as the ref)."""
        import ray

        if self.val_ref is None:
            rows = pack_val_rows(self.val.val_sequences(), self.p.train)
            self.val_ref = ray.put([to_store(row, True) for row in rows])
        return [self.val_ref]

    def next_item(self, trainer: int, start: tuple) -> tuple[int, int, dict]:
        """(epoch, index, micro-batch) of this trainer's next micro-batch in the stream from `start` (epoch, index,
        sequence: the checkpoint's position, the same on every trainer); its states only if it trains it."""
        if self.failed:
            raise TrainingError(f"the capture failed earlier: {self.failed}")
        if self.stream is None:
            epoch, index, sequence = start
            self.start = start
            # no thread: the outstanding calls bound how far ahead this actor captures
            self.stream = micro_batches(self.train.train_sequences, self.p.train, epoch, index, sequence, depth=0)
        elif tuple(start) != tuple(self.start):
            raise TrainingError(f"trainers resume from different positions: {tuple(start)} and {tuple(self.start)}")
        n = self.taken[trainer]
        while n >= self.made:
            try:
                self.items[self.made] = next(self.stream)
            except Exception as e:
                self.failed = f"{type(e).__name__}: {e}"
                raise
            self.made += 1
        epoch, index, mb = self.items[n]
        self.taken[trainer] += 1
        if min(self.taken) > n:
            del self.items[n]
        return epoch, index, to_store(mb, n % self.trainers == trainer)

    def close(self) -> None:
        """The target let go (an engine's tensor-parallel ranks stopped) before the driver ends this actor."""
        if self.train is not None:
            self.train.close()

    def summary(self) -> dict:
        """The capture's figures, written beside train_summary.json (the run folder every node sees)."""
        import json

        stats = online.online_stats(self.train)
        (self.run_dir / "02_train" / CAPTURE_SUMMARY).write_text(json.dumps(stats, indent=2) + "\n")
        return stats


class TrainerActor:
    """One trainer: runs the stage (launch.run_stage, handed in by the driver) with the capture actor."""

    def ready(self) -> bool:
        return True

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it, for torch.distributed's rendezvous."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def train(self, run_stage, params_file: str, run_dir: str, overrides: dict, capture, env: dict) -> dict:
        from eagle3lib.params import load_params, stage_view

        os.environ.update(env)
        return run_stage(stage_view(load_params(params_file, overrides), "02_train"), run_dir, handed=capture)


class RayCaptureClient:
    """A trainer's side, a BatchSource: the validation rows, then the stream of micro-batches from a loop state's
    position."""

    def __init__(self, capture, trainer: int, contract: dict):
        self.ray = import_ray()
        self.capture, self.trainer, self.contract = capture, trainer, contract

    def summary(self) -> dict:
        return {}  # the capture actor writes its own (CAPTURE_SUMMARY)

    def close(self) -> None:
        pass

    def _get(self, ref):
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayError as e:
            raise TrainingError(f"the capture actor failed: {getattr(e, 'cause', None) or e}") from e

    def val_rows(self, train_params=None) -> list[dict]:
        """The capture actor packed them (with the same train params)."""
        (ref,) = self._get(self.capture.val_rows.remote())
        return [from_store(row) for row in self._get(ref)]

    def stream(self, train_params, state: dict):
        """(epoch, index, micro-batch) from the state's position, train.online_queue_batches calls outstanding."""
        sequence = state.get("sequence_in_epoch")
        start = (state["epoch"], state["micro_in_epoch"], sequence)
        pending = deque(
            self.capture.next_item.remote(self.trainer, start) for _ in range(train_params.online_queue_batches)
        )
        try:
            while True:
                got = self._get(pending.popleft())
                pending.append(self.capture.next_item.remote(self.trainer, start))
                epoch, index, stored = got
                yield epoch, index, from_store(stored)
        finally:
            # the calls in flight complete (the capture makes what they asked for), so its summary is whole and
            # every trainer has taken the same micro-batches when the driver ends the actors
            for ref in pending:
                try:
                    self.ray.get(ref)
                except self.ray.exceptions.RayError:
                    break


# -------------------------------------------------------------------------------- the driver ----


def connect(ray, p) -> None:
    """Join the cluster at train.ray_address or RAY_ADDRESS, else start one on this host; a driver already
    connected stays so."""
    if ray.is_initialized():
        return
    address = p.train.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        start_local(ray, store_bytes(p))


def start_local(ray, object_store_bytes: int, num_cpus: int | None = None) -> None:
    """A Ray cluster on this host for this process: num_cpus (default this host's cores), a small object store, no
    dashboard."""
    # its processes (the agents, the actors) import the ray and eagle3lib this process imported, even from a folder
    # only on sys.path (tests' .ray-site): they inherit this environment while ray.init starts them
    homes = {str(Path(m.__file__).resolve().parents[1]) for m in (ray, sys.modules["eagle3lib"])}
    before = os.environ.get("PYTHONPATH")
    path = [*sorted(homes), *filter(None, (before or "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    try:
        ray.init(num_cpus=num_cpus or os.cpu_count(), object_store_memory=object_store_bytes, include_dashboard=False)
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def store_bytes(p) -> int:
    """The local object store: the micro-batches in flight (online_queue_batches per trainer, and one each being
    read) and the validation rows, twice over, from the target's config."""
    from eagle3lib import target
    from eagle3lib.params import cache_dir

    cfg = target.load_config(target.resolve_target(p.target.name, cache_dir(p)), p.target.trust_remote_code)
    layers = target.num_layers(cfg)
    per_token = (len(target.aux_layer_ids(p.target.aux_layer_ids, layers)) + 1) * target.text_config(cfg).hidden_size
    per_token *= torch.finfo(target.torch_dtype(p.target.dtype)).bits // 8
    t = p.train
    tokens = (t.online_queue_batches + 1) * t.nproc_per_node * t.batch_rows * t.max_seq_len + t.eval_max_tokens
    return max(LOCAL_STORE_MIN, 2 * tokens * per_token)


def bundle(on_gpu: bool, gpus: int = 1) -> dict:
    """What one actor takes: a core, and its GPUs on CUDA (a trainer one; Ray then runs its torch on one thread)."""
    return {"CPU": 1, "GPU": gpus} if on_gpu else {"CPU": 1}


def place(ray, bundles: list[dict]):
    """A placement group of these bundles (the capture's first, then one per trainer), ready: a clear error when the
    cluster has not the resources."""
    from ray.util.placement_group import placement_group, remove_placement_group

    have, trainers = ray.cluster_resources(), len(bundles) - 1
    for kind in bundles[0]:
        need = sum(b.get(kind, 0) for b in bundles)
        if have.get(kind, 0) < need:
            raise TrainingError(
                f"train.online_placement: ray needs {need} {kind}s (a capture actor of {bundles[0]} and "
                f"train.nproc_per_node={trainers} trainers of {bundles[-1]}) and the Ray cluster has "
                f"{have.get(kind, 0):g}: lower train.nproc_per_node, or add nodes (ray start --address=...)"
            )
    group = placement_group(bundles, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=PLACE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError as e:
        remove_placement_group(group)
        raise TrainingError(
            f"Ray could not place {len(bundles)} actors ({bundles[0]} for the capture, {bundles[-1]} for each "
            f"trainer) in {PLACE_TIMEOUT_S} s (the cluster holds {have}; other jobs may hold part of it, and the "
            "capture's bundle must fit one node): free them, or lower train.nproc_per_node"
        ) from e
    return group


def local_gpus(p) -> int:
    """For the plan: the GPUs of the cluster launch would start on this host (-1 where it joins a running one)."""
    if p.train.ray_address or os.environ.get("RAY_ADDRESS"):
        return -1
    return torch.cuda.device_count()


def result(ray, ref):
    """An actor call's result; its failure raised as the error the actor raised (a TrainingError says what to
    change), not wrapped in Ray's."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, Exception):
            raise cause from e
        raise TrainingError(f"a Ray actor failed: {e}") from e


class RayActors(OnlinePlacement):
    """A capture actor and train.nproc_per_node trainer actors, placed by Ray (this host's or a cluster's)."""

    name = "ray"

    def launch(self, run: StageRun) -> dict:
        """Run 02_train with the capture and train.nproc_per_node trainers as Ray actors. Returns the first trainer's
        summary."""
        ray = import_ray()
        from ray.util.placement_group import remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        p, stage, trainers, overrides = run.p, run.run_stage, run.p.train.nproc_per_node, run.p.overrides
        # the actors may start elsewhere (another node, another working directory)
        params_file, run_dir = str(Path(p.file).resolve()), str(Path(run.run_dir).resolve())
        runtime_env = self.capture_runtime_env(p, ray)
        connect(ray, p)
        bundles = self.bundles(p, ray.cluster_resources())
        group = place(ray, bundles)
        actors = []
        try:

            def start(cls, index: int, *args, **options):
                where = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
                res = {"num_cpus": 1, "num_gpus": bundles[index].get("GPU", 0)}
                actors.append(ray.remote(cls).options(**res, scheduling_strategy=where, **options).remote(*args))
                return actors[-1]

            settings = actor_overrides(p, overrides)
            env = {"runtime_env": runtime_env} if runtime_env else {}
            capture = start(CaptureActor, 0, params_file, run_dir, settings, trainers, **env)
            workers = [start(TrainerActor, 1 + r) for r in range(trainers)]
            for a in actors:
                result(ray, a.ready.remote())
            result(ray, capture.load.remote())
            envs = [{}]
            if trainers > 1:  # torch.distributed among the trainers, its rendezvous on the first one's node
                host, port = result(ray, workers[0].address.remote())
                common = {"MASTER_ADDR": host, "MASTER_PORT": str(port), "WORLD_SIZE": str(trainers), "LOCAL_RANK": "0"}
                envs = [common | {"RANK": str(r)} for r in range(trainers)]
            runs = [
                w.train.remote(stage, params_file, run_dir, settings, capture, e)
                for w, e in zip(workers, envs, strict=True)
            ]
            pending = list(runs)
            while pending:  # a failed trainer's error at once (the others may wait on it in a collective)
                done, pending = ray.wait(pending, num_returns=1)
                result(ray, done[0])
            result(ray, capture.summary.remote())
            return result(ray, runs[0])
        finally:
            if actors:  # the capture's engine stopped in order (its ranks are its own processes), then every actor
                try:
                    ray.get(actors[0].close.remote(), timeout=CLOSE_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - a capture that failed or hangs is killed below all the same
                    pass
            for a in actors:
                ray.kill(a)
            remove_placement_group(group)

    def bundles(self, p, have: dict) -> list[dict]:
        """The capture actor's bundle, then each trainer's: a GPU each on CUDA, except on a cluster of one GPU with
        one trainer and a one-GPU capture, where each takes half of it (Ray's fractional GPUs: both see it, as the
        process placement shares one host's; the states go through the object store either way)."""
        on_gpu, trainers = p.target.device.startswith("cuda"), p.train.nproc_per_node
        capture, trainer = self.capture_bundle(p), bundle(on_gpu)
        if self.shares_gpu(p, have.get("GPU", 0)):
            capture, trainer = capture | {"GPU": 0.5}, trainer | {"GPU": 0.5}
        return [capture] + [trainer] * trainers

    def shares_gpu(self, p, gpus: float) -> bool:
        """Whether the capture and the one trainer share the cluster's one GPU (gpus: the cluster's)."""
        on_gpu = p.target.device.startswith("cuda")
        return on_gpu and gpus == 1 and p.train.nproc_per_node == 1 and self.capture_bundle(p).get("GPU") == 1

    def capture_bundle(self, p) -> dict:
        """What the capture actor takes: a core, and a GPU on CUDA."""
        return bundle(p.target.device.startswith("cuda"))

    def capture_runtime_env(self, p, ray) -> dict | None:
        """The capture actor's Ray runtime environment (None: the driver's interpreter and environment)."""
        return None

    def check_started(self, proc: StageProcess) -> None:
        if proc.handed is None:
            raise TrainingError(
                "train.online_placement: ray runs the capture and the trainers as Ray actors: start the stage with "
                "launch.launch (the 02_train notebook and `python -m eagle3lib run` do), or set "
                "train.online_placement: thread"
            )

    def open(self, proc: StageProcess, tokens: dict) -> RayCaptureClient:
        from eagle3lib.train.distributed import rank_and_world

        return RayCaptureClient(proc.handed, rank_and_world()[0], online.contract_without_weights(proc.p))

    def device_split(self, p) -> tuple[str, bool]:
        trainers = p.train.nproc_per_node
        if p.target.device.startswith("cuda"):
            if self.shares_gpu(p, local_gpus(p)):
                return (
                    "Ray places a capture actor and 1 trainer actor on this host's one GPU, half of it each (object store)",
                    True,
                )
            split = f"Ray places a capture actor on a GPU and {trainers} trainer actor(s) on a GPU each (object store)"
            return split, False
        # as the processes: the cores of one CPU, unless a cluster has more
        return f"Ray places a capture actor and {trainers} trainer actor(s) on a CPU core each (object store)", True


class InEngineRay(RayActors):
    """The Ray placement with SGLang's model runner as the capture (extract.backend sglang_inprocess): the capture
    actor runs in SGLang's interpreter on SGLang's --tp GPUs of one node; the trainer actors in this interpreter."""

    name = "ray (sglang_inprocess)"

    def capture_bundle(self, p) -> dict:
        return bundle(p.target.device.startswith("cuda"), engine_tp_gpus(p))

    def capture_runtime_env(self, p, ray) -> dict:
        """Ray's py_executable: SGLang's interpreter, with engine.env and this eagle3lib first on its path; checked
        here first (on this host) to import this Ray and this eagle3lib, since a worker that cannot start leaves
        Ray retrying it."""
        from eagle3lib.engines.interpreter import module_env
        from eagle3lib.extract.backends import engine_settings

        engine = engine_settings(p, "sglang")
        python = engine["python"]
        if python is None:
            raise FileNotFoundError(
                "train.source: online with extract.backend sglang_inprocess captures in SGLang's interpreter and none "
                "was found: set engine.name: sglang and engine.python, or build .venv-sglang (make sglang-env)"
            )
        # engine.env, and the path the process placement's capture gets: this eagle3lib first, then engine.env's
        # PYTHONPATH or this process's (a Ray worker otherwise inherits its raylet's environment)
        env = {k: str(v) for k, v in engine["env"].items()} | {"PYTHONPATH": module_env(engine["env"])["PYTHONPATH"]}
        check = "import ray, eagle3lib; print(ray.__version__)"
        proc = subprocess.run(
            [python, "-c", check], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
        )
        found = proc.stdout.strip().splitlines()[-1:] if proc.returncode == 0 else []
        if found != [ray.__version__]:
            why = f"it has Ray {found[0]}" if found else f"`import ray, eagle3lib` failed: {proc.stderr.strip()[-600:]}"
            raise TrainingError(
                "train.online_placement: ray with extract.backend sglang_inprocess runs the capture actor in SGLang's "
                f"interpreter ({python}), which needs this Ray ({ray.__version__}) on every node: {why}. Install it "
                f"there (`{python} -m pip install 'ray=={ray.__version__}'`), or set train.online_placement: process "
                "(one host)"
            )
        return {"py_executable": python, "env_vars": env}

    def device_split(self, p) -> tuple[str, bool]:
        k, n = engine_tp_gpus(p), p.train.nproc_per_node
        if not p.target.device.startswith("cuda") or self.shares_gpu(p, local_gpus(p)):
            return super().device_split(p)
        return (
            f"Ray places SGLang's model runner in a capture actor (SGLang's interpreter) on {k} GPU(s) of one node and "
            f"{n} trainer actor(s) on a GPU each (object store)",
            False,
        )
