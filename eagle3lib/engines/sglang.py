"""SGLang: what this project knows of it (the aux-id rule, the launch flags) and its server.

GPU hosts only: SGLang cannot serve on our CPUs; everything up to the launch is tested here.
Launch: python -m sglang.launch_server --model-path T --speculative-algorithm EAGLE3
        --speculative-draft-model-path D --speculative-num-steps d --speculative-eagle-topk 1
        --speculative-num-draft-tokens d+1
The flags are checked before launch: check_sglang_args (pure Python) in start(), and SGLang's own
ServerArgs resolution in preflight() (needs sglang; the deploy, convert and extract stages
use it).
Generation: POST /generate with input_ids, greedy, ignore_eos. Statistics come per request from
`meta_info` (/server_info's avg_spec_accept_length is a lifetime figure): aggregate_meta sums them.

Aux ids, as read in SGLang 0.5.17 python/sglang/srt/models/llama.py: set_eagle3_layers_to_capture(ids) sets
layers_to_capture = [i + 1 for i in ids] and LlamaModel.forward appends hidden+residual *before* running
layer i, i.e. the output of layer i-1 = HF hidden_states[i]. So SGLang's config id j is HF index j+1:
sglang = ours - 1. Its default (no ids) [2, L//2, L-3] is used without the +1, i.e. HF [2, L//2, L-3] = our
default. DeepSeek-V2/V3 (Kimi-K2.5) and GLM-4-MoE-Lite add 1 only when the first id is 1 (SGLANG_FIRST_ID_RULE).
"""

from __future__ import annotations

import json

from eagle3lib.drafter.aux_ids import SGLANG_FIRST_ID_RULE, sglang_captured_ids, sglang_config_ids  # noqa: F401
from eagle3lib.engines.interpreter import run_engine_side
from eagle3lib.engines.schedule import DepthSchedule, as_schedule
from eagle3lib.engines.server import EngineError, Server, http_json
from eagle3lib.engines.serving_bench import SglangBenchServing

SGLANG_VERSION = "0.5.17"  # the release whose code (loader, capture rule, ServerArgs) this project follows
SGLANG_CONVENTION = "sglang_layer_output"  # SGLang id j = output of layer j = HF hidden_states[j+1]


def sglang_launch_args(draft_dir, depth: int | DepthSchedule, config_dir=None) -> list[str]:
    """SGLang flags for a chain of `depth` drafted tokens with top-k 1 (docs/design.md §5); for a schedule, its
    deepest chain with the adaptive controller held to the schedule's depth per batch size (its config file
    written into config_dir)."""
    schedule = as_schedule(depth)
    deepest = schedule.max_depth
    flags = [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        str(draft_dir),
        "--speculative-num-steps",
        str(deepest),
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(deepest + 1),
    ]
    if schedule.is_fixed:
        return flags
    if config_dir is None:
        raise ValueError(f"SGLang reads a depth schedule from a file: give the folder to write {schedule.name()}'s")
    return flags + [
        "--speculative-adaptive",
        "--speculative-adaptive-config",
        str(schedule.write_sglang_config(config_dir)),
    ]


def check_sglang_args(args: list[str]) -> list[str]:
    """Problems with SGLang launch flags for an EAGLE-3 drafter (empty list: fine)."""

    def value(flag):
        return args[args.index(flag) + 1] if flag in args and args.index(flag) + 1 < len(args) else None

    problems = []
    algo = value("--speculative-algorithm")
    if algo != "EAGLE3":
        problems.append(
            f"--speculative-algorithm is {algo!r}, expected 'EAGLE3': with 'EAGLE' SGLang runs an EAGLE-3 drafter "
            "without the target's aux hidden states and accepts ~nothing (acceptance 1.00, no warning)."
        )
    steps, topk, tokens = (
        value("--speculative-num-steps"),
        value("--speculative-eagle-topk"),
        value("--speculative-num-draft-tokens"),
    )
    if topk != "1" or steps is None or tokens is None or int(tokens) != int(steps) + 1:
        problems.append(
            f"expected a top-k 1 chain: --speculative-eagle-topk 1 and --speculative-num-draft-tokens = "
            f"--speculative-num-steps + 1, found topk={topk}, steps={steps}, draft tokens={tokens}."
        )
    if value("--speculative-draft-model-path") is None:
        problems.append("--speculative-draft-model-path is missing.")
    return problems


def tp_size(flags) -> int:
    """The tensor-parallel size launch flags ask SGLang for (--tp-size, --tensor-parallel-size or --tp, the value
    after a space or `=`; the last one wins, as argparse reads them), 1 when none does."""
    flags, size = [str(f) for f in flags], 1
    for i, flag in enumerate(flags):
        name, eq, value = flag.partition("=")
        if name in ("--tp", "--tp-size", "--tensor-parallel-size") and (eq or i + 1 < len(flags)):
            size = int(value if eq else flags[i + 1])
    return size


def server_flags(target_dir, draft_dir=None, depth=None, extra_args=(), config_dir=None) -> list[str]:
    """Launch flags without --host/--port (Server adds them): the target, the drafter's top-k 1 chain of
    `depth` tokens or a DepthSchedule's (None: no speculation), then extra_args."""
    schedule = as_schedule(depth)
    spec = sglang_launch_args(draft_dir, schedule, config_dir) if schedule else []
    return ["--model-path", str(target_dir)] + spec + list(extra_args)


def preflight(
    target_dir,
    draft_dir,
    depth: int | None,
    python: str,
    extra_args=(),
    aux_layer_ids=None,
    require: dict | None = None,
    device: str | None = "cpu",
    raises: bool = True,
) -> dict:
    """SGLang's own resolution of the launch server_flags(...) builds (engines/engine_side/load_check.py in its
    interpreter) and what is wrong with it: load_check's report, its `problems` completed with
    check_sglang_args, `require` and the layers the target will capture (`captured_hf_layers`). Raises
    EngineError listing the problems, unless raises=False (the convert gate reports them).

    aux_layer_ids: the HF hidden_states ids the target must capture (EAGLE3 launches); default, the
        drafter's contract's. SGLang's own reading of the target (class, layer count) decides what its ids
        capture (sglang_captured_ids).
    require: {ServerArgs field: (value, why)} the launch must resolve to.
    device: passed as --device; "cpu" resolves without a GPU, None as the server itself would.
    """
    args = server_flags(target_dir, draft_dir, depth, extra_args) + (["--device", device] if device else [])
    report = run_engine_side("load_check.py", ["sglang", "--args", json.dumps(args)], python)
    report["args"] = args
    problems = (check_sglang_args(args) if depth else []) + report.get("problems", [])
    resolved = report.get("resolved", {})
    for field, (want, why) in (require or {}).items():
        if resolved.get(field) != want:
            problems.append(f"{field} resolved to {resolved.get(field)!r}, expected {want!r}: {why}.")
    ids = report.get("eagle_aux_hidden_state_layer_ids")
    architecture = (report.get("target_architectures") or [None])[0]
    captured = sglang_captured_ids(ids, architecture, report.get("target_num_layers") or 0) if ids else None
    report["captured_hf_layers"] = captured
    if captured is not None:
        want = f"{aux_layer_ids} were asked for"
        if aux_layer_ids is None:
            from eagle3lib.target import read_contract

            aux_layer_ids = read_contract(draft_dir).get("aux_layer_ids")
            want = f"the drafter was trained on {aux_layer_ids}: re-export it with eagle3lib.convert.layouts"
        if captured != [int(i) for i in aux_layer_ids]:
            problems.append(
                f"SGLang will capture HF hidden_states {captured} (config ids {ids} on a {architecture} target), "
                f"but {want}."
            )
    report["problems"] = problems
    if problems and raises:
        raise EngineError(f"SGLang would not run `{' '.join(args)}` as asked:\n  " + "\n  ".join(problems))
    return report


def aggregate_meta(metas: list[dict]) -> dict:
    """Acceptance over requests from SGLang's per-request meta_info (docs/design.md §5):
    accept_len = Σ completion_tokens / Σ spec_verify_ct; per_pos[k] = share of verify steps that
    accepted more than k drafts (from spec_correct_drafts_histogram: entry n = steps with n correct)."""
    tokens = sum(m.get("completion_tokens", 0) for m in metas)
    verify = sum(m.get("spec_verify_ct", 0) for m in metas)
    hist: list[int] = []
    for m in metas:
        for n, count in enumerate(m.get("spec_correct_drafts_histogram") or []):
            hist += [0] * (n + 1 - len(hist))
            hist[n] += count
    steps = sum(hist)
    per_pos = [sum(hist[k + 1 :]) / steps for k in range(len(hist) - 1)] if steps else []
    return {
        "drafts": verify,
        "accepted": sum(m.get("spec_num_correct_drafts", 0) for m in metas),
        "completion_tokens": tokens,
        "accept_len": tokens / verify if verify else None,
        "per_pos": per_pos,
        "histogram": hist,
    }


class SGLang(Server):
    name = "sglang"
    context_flag = "--context-length"  # the launch flag that limits the served context
    serving_bench = SglangBenchServing()  # the load generator run against it

    def start(self) -> float:
        problems = check_sglang_args(self.base_command) if "--speculative-algorithm" in self.base_command else []
        if problems:
            raise EngineError("SGLang launch flags for an EAGLE-3 drafter are wrong:\n  " + "\n  ".join(problems))
        return super().start()

    def complete(self, prompt_ids: list[int], sampling: dict) -> dict:
        """SGLang's /generate on token ids (max_tokens is its max_new_tokens)."""
        params = {("max_new_tokens" if k == "max_tokens" else k): v for k, v in sampling.items()}
        r = http_json(
            self.url + "/generate", {"input_ids": prompt_ids, "sampling_params": params}, self.request_timeout_s
        )
        meta = r.get("meta_info", {})
        finish = meta.get("finish_reason")
        return {
            "token_ids": r.get("output_ids"),
            "text": r["text"],
            "completion_tokens": meta.get("completion_tokens"),
            "finish_reason": finish.get("type") if isinstance(finish, dict) else finish,
            "meta": meta,
        }

    def stats(self) -> dict:
        """Lifetime figures from /server_info (average acceptance since start); per-configuration figures
        come from aggregate_meta over the requests' meta_info."""
        with self.answering():
            info = http_json(self.url + "/server_info", timeout=30)
        states = info.get("internal_states") or [{}]
        return {"avg_spec_accept_length": states[0].get("avg_spec_accept_length")}
