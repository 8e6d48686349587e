"""SGLang's server (GPU hosts only: it cannot serve on our CPUs; everything up to the launch is tested here).

Launch: python -m sglang.launch_server --model-path T --speculative-algorithm EAGLE3
        --speculative-draft-model-path D --speculative-num-steps d --speculative-eagle-topk 1
        --speculative-num-draft-tokens d+1
The flags are checked before launch the way the convert stage checks them: export.check_sglang_args
(pure Python) in start(), and SGLang's own ServerArgs resolution in preflight() (needs sglang).
Generation: POST /generate with input_ids, greedy, ignore_eos. Statistics come per request from
`meta_info` (/server_info's avg_spec_accept_length is a lifetime figure): aggregate_meta sums them.
"""

from __future__ import annotations

import json
import time

from eagle3lib.convert import layouts
from eagle3lib.engines.server import EngineError, Server, http_json


def preflight(target_dir, draft_dir, depth: int, python: str) -> dict:
    """Resolve the launch flags with SGLang's own prepare_server_args (--device cpu, no GPU needed) and
    check them; returns the resolved report, raises EngineError listing the problems."""
    args = ["--model-path", str(target_dir), "--device", "cpu"] + layouts.sglang_launch_args(draft_dir, depth)
    problems = layouts.check_sglang_args(args)
    report = layouts.run_engine_check(["sglang", str(draft_dir), "--args", json.dumps(args)], python)
    problems += report.get("problems", [])
    contract = layouts.read_contract(draft_dir)
    ids = report.get("eagle_aux_hidden_state_layer_ids")
    report["captured_hf_layers"] = (
        layouts.sglang_captured_ids(ids, contract.get("target_architecture"), contract.get("num_layers") or 0)
        if ids
        else None
    )
    if ids and report["captured_hf_layers"] != contract.get("aux_layer_ids"):
        problems.append(
            f"SGLang will capture HF hidden_states {report['captured_hf_layers']}, the drafter was "
            f"trained on {contract.get('aux_layer_ids')}: re-export it with eagle3lib.convert.layouts."
        )
    if problems:
        raise EngineError("SGLang would not run the drafter as asked:\n  " + "\n  ".join(problems))
    return report


def aggregate_meta(metas: list[dict]) -> dict:
    """Acceptance over requests from SGLang's per-request meta_info (DESIGN.md §5):
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

    def start(self) -> float:
        problems = (
            layouts.check_sglang_args(self.base_command) if "--speculative-algorithm" in self.base_command else []
        )
        if problems:
            raise EngineError("SGLang launch flags for an EAGLE-3 drafter are wrong:\n  " + "\n  ".join(problems))
        return super().start()

    def generate(
        self, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = True, stop_token_ids: list[int] | None = None
    ) -> dict:
        """Greedy completion of token ids: {token_ids, text, completion_tokens, seconds, finish_reason, meta}."""
        t0 = time.perf_counter()
        sampling = {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": ignore_eos}
        if stop_token_ids:
            sampling["stop_token_ids"] = list(stop_token_ids)
        r = http_json(self.url + "/generate", {"input_ids": prompt_ids, "sampling_params": sampling})
        seconds = time.perf_counter() - t0
        meta = r.get("meta_info", {})
        finish = meta.get("finish_reason")
        return {
            "token_ids": r.get("output_ids"),
            "text": r["text"],
            "completion_tokens": meta.get("completion_tokens"),
            "seconds": seconds,
            "finish_reason": finish.get("type") if isinstance(finish, dict) else finish,
            "meta": meta,
        }

    def stats(self) -> dict:
        """Lifetime figures from /server_info (average acceptance since start); per-configuration figures
        come from aggregate_meta over the requests' meta_info."""
        info = http_json(self.url + "/server_info", timeout=30)
        states = info.get("internal_states") or [{}]
        return {"avg_spec_accept_length": states[0].get("avg_spec_accept_length")}
