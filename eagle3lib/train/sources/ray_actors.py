"""train.online_placement: ray. Ray places one capture actor (the target's device: a GPU on CUDA, a CPU core
otherwise) and train.nproc_per_node trainer actors (a GPU each on CUDA), on this host or on the hosts of a running
cluster (RAY_ADDRESS or train.ray_address); the micro-batches go through Ray's object store: shared memory on one
node, Ray's object transfer between nodes (docs/design.md §8, online mode). What runs in the actors, and how a
trainer takes its micro-batches from the capture actor: sources/ray_link.py.

Several trainers sum their gradients over torch.distributed among themselves (gloo on the CPU, NCCL on GPUs),
MASTER_ADDR and MASTER_PORT taken on the first trainer's node, as Ray Train does; one trainer needs none.

With extract.backend sglang_inprocess (InEngineRay) the capture actor runs in SGLang's interpreter (Ray's
py_executable: engine.python, else .venv-sglang, which must have this Ray) and takes SGLang's --tp GPUs of one
node, its model runner's tensor-parallel ranks its own processes there; the trainers stay in this interpreter,
wherever Ray places them: a Kimi-sized target on one node's GPUs, its trainers on another's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from eagle3lib.train import TrainingError
from eagle3lib.train.sources import online
from eagle3lib.train.sources.base import OnlinePlacement, StageProcess, StageRun
from eagle3lib.train.sources.process import engine_tp_gpus, sglang_engine
from eagle3lib.train.sources.ray_link import CaptureActor, RayCaptureClient, TrainerActor, actor_overrides, import_ray

PLACE_TIMEOUT_S = 120  # a cluster whose free resources fit the totals but no node takes an actor: say so, not hang
CLOSE_TIMEOUT_S = 120  # the capture's engine stopping (its ranks' processes ending) before its actor is killed
LOCAL_STORE_MIN = 128 * 2**20  # the local cluster's object store floor; Ray spills to disk past it (slower, same)
REAPER = Path(__file__).resolve().parent / "ray_reaper.py"  # run, not imported: stdlib only


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


def start_local(ray, object_store_bytes: int, num_cpus: int | None = None) -> Path:
    """A Ray cluster on this host for this process: num_cpus (default this host's cores), a small object store, no
    dashboard, Ray's temp dir a folder of its own (returned); its processes are ended with this one however it
    dies (ray_reaper.py)."""
    # its processes (the agents, the actors) import the ray and eagle3lib this process imported, even from a folder
    # only on sys.path (tests' .ray-site): they inherit this environment while ray.init starts them. Under /tmp:
    # Ray's socket paths must stay under 107 bytes.
    folder = Path(tempfile.mkdtemp(prefix="eagle3-ray-", dir="/tmp"))
    homes = {str(Path(m.__file__).resolve().parents[1]) for m in (ray, sys.modules["eagle3lib"])}
    before = {k: os.environ.get(k) for k in ("PYTHONPATH", "RAY_TMPDIR")}
    path = [*sorted(homes), *filter(None, (before["PYTHONPATH"] or "").split(os.pathsep))]
    os.environ.update({"PYTHONPATH": os.pathsep.join(dict.fromkeys(path)), "RAY_TMPDIR": str(folder)})
    try:
        ray.init(num_cpus=num_cpus or os.cpu_count(), object_store_memory=object_store_bytes, include_dashboard=False)
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    subprocess.Popen(
        [sys.executable, str(REAPER), str(os.getpid()), str(folder)],
        start_new_session=True,  # not in this process's group: a Ctrl-C here does not end it first
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return folder


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
        from eagle3lib.train.runtime.distributed import rank_and_world

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

        engine = sglang_engine(p)
        python = engine["python"]
        # engine.env, and the path the process placement's capture gets: this eagle3lib first, then engine.env's
        # PYTHONPATH or this process's (a Ray worker otherwise inherits its raylet's environment)
        env = {k: str(v) for k, v in engine["env"].items()} | {"PYTHONPATH": module_env(engine["env"])["PYTHONPATH"]}
        check = "import ray, eagle3lib; print(ray.__version__)"
        try:
            proc = subprocess.run(
                [python, "-c", check], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
            )
            found = proc.stdout.strip().splitlines()[-1:] if proc.returncode == 0 else []
            failed = proc.stderr.strip()[-600:]
        except (OSError, subprocess.TimeoutExpired) as e:  # no such interpreter here, or one that hangs
            found, failed = [], f"{type(e).__name__}: {e}"
        if found != [ray.__version__]:
            why = f"it has Ray {found[0]}" if found else f"`import ray, eagle3lib` failed: {failed}"
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
