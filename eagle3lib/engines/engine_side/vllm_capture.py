"""vLLM's side of the vllm extraction backend, run in vLLM's interpreter (.venv-vllm) by eagle3lib.extract.vllm.

    python eagle3lib/engines/engine_side/vllm_capture.py capture --target DIR --layers 2,15,27,30 --work DIR [--dtype D] [-- FLAGS...]
    python eagle3lib/engines/engine_side/vllm_capture.py prefill --target DIR --tokens FILE --warmup K [--dtype D] [-- FLAGS...]

Standalone on purpose (stdlib, torch, safetensors and vLLM only): vLLM pins a transformers that our .venv
does not have. FLAGS are vLLM's own engine flags (as for `vllm serve`: --tensor-parallel-size,
--max-model-len, --enforce-eager...), parsed by vLLM's EngineArgs.

capture: one vllm.LLM with the `extract_hidden_states` speculative method (draft config naming
    eagle_aux_hidden_state_layer_ids = --layers, vLLM's convention = HF hidden_states indices, the last
    one L = the state after the last layer, before the final norm), num_speculative_tokens 1, prefix
    caching off, and the hidden-states KV-transfer connector (ours on CPUs, vLLM's on GPUs) writing
    each request's rows [T, len(layers), H] to --work. Then it serves requests, one JSON line each on
    stdin: {"tokens": FILE, "out": FILE}; FILE holds input_ids int32 [N] and seq_starts int64 [S+1];
    it generates one token per sequence (max_tokens 1), checks the rows' token ids against the prompt,
    writes `hidden` [N, len(layers), H] (engine dtype) to "out" and answers one line. EOF ends it.
prefill: a plain vllm.LLM (no speculation); times its prefill (max_tokens 1) of the sequences in
    --tokens after the first --warmup, and answers one line with tokens/s.
Protocol lines on stdout start with "@@eagle3lib "; everything else there is vLLM's log.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
PREFIX = "@@eagle3lib "
CONNECTOR_MODULE = "vllm_connector"  # this folder is on the engine's PYTHONPATH


def say(obj):
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def fp32_mla_flags(target, dtype):
    """An MLA target (DeepSeek-V3's shape) in float32: vLLM's CPU build picks AMX_MLA on a CPU with AMX, which packs
    its weights for bf16 only and refuses fp32 at load ("expect weight to be bfloat16, ..."); its reference CPU MLA
    backend takes fp32."""
    if dtype != "float32":
        return []
    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    return ["--attention-backend", "CPU_MLA"] if "kv_lora_rank" in config.get("text_config", config) else []


def engine_kwargs(target, dtype, flags):
    """vllm.LLM keyword arguments from vLLM's own CLI parser (the flags `vllm serve` takes)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(
        ["--model", target] + (["--dtype", dtype] if dtype else []) + fp32_mla_flags(target, dtype) + list(flags)
    )
    args = EngineArgs.from_cli_args(ns)
    defaults = EngineArgs(model=target)
    # Only what the flags changed: LLM() fills the rest with its own defaults.
    return {k: v for k, v in vars(args).items() if k != "model" and getattr(defaults, k, None) != v} | {"model": target}


def read_sequences(path):
    from safetensors.torch import load_file

    t = load_file(path)
    ids, starts = t["input_ids"].tolist(), t["seq_starts"].tolist()
    return [ids[a:b] for a, b in zip(starts[:-1], starts[1:])]


def hidden_rows(seqs, outs, n_layers):
    """The hidden states the connector saved for each request, [tokens, n_layers, H] each, checked against its prompt."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    rows = []
    for s, o in zip(seqs, outs):
        path = (o.kv_transfer_params or {}).get("hidden_states_path")
        if path is None:
            raise RuntimeError(
                f"request {o.request_id} came back without kv_transfer_params.hidden_states_path; "
                "is the hidden-states connector configured?"
            )
        got = load_hidden_states(path)
        cleanup_hidden_states(path)
        if got["token_ids"].tolist() != s:
            raise RuntimeError(
                f"request {o.request_id}: the connector saved rows for other tokens "
                f"({got['token_ids'].numel()} ids) than the prompt ({len(s)} ids)"
            )
        h = got["hidden_states"]
        if tuple(h.shape[1:]) != (n_layers, h.shape[-1]) or h.shape[0] != len(s):
            raise RuntimeError(
                f"request {o.request_id}: rows of shape {tuple(h.shape)}, expected [{len(s)}, {n_layers}, H]"
            )
        rows.append(h)
    return rows


def capture(a, flags):
    import torch
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    layers = [int(x) for x in a.layers.split(",")]
    on_gpu = torch.cuda.is_available()
    connector = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": a.work},
    }
    if not on_gpu:
        connector.update(kv_connector="CPUHiddenStatesConnector", kv_connector_module_path=CONNECTOR_MODULE)
    kw = engine_kwargs(a.target, a.dtype, flags)
    kw.update(
        enable_prefix_caching=False,
        kv_transfer_config=connector,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
        },
    )
    t0 = time.time()
    llm = LLM(**kw)
    say(
        {
            "ready": True,
            "start_s": round(time.time() - t0, 1),
            "connector": connector["kv_connector"],
            "vllm_version": __import__("vllm").__version__,
            "dtype": str(llm.llm_engine.model_config.dtype),
        }
    )
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        t1 = time.time()
        seqs = read_sequences(req["tokens"])
        outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, use_tqdm=False)
        rows = hidden_rows(seqs, outs, len(layers))
        tmp = req["out"] + ".tmp"
        save_file({"hidden": torch.cat(rows).contiguous()}, tmp)
        os.replace(tmp, req["out"])
        say(
            {
                "ok": True,
                "out": req["out"],
                "sequences": len(seqs),
                "tokens": sum(map(len, seqs)),
                "seconds": round(time.time() - t1, 3),
            }
        )


def prefill(a, flags):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = engine_kwargs(a.target, a.dtype, flags)
    kw.update(enable_prefix_caching=False)
    t0 = time.time()
    llm = LLM(**kw)
    start_s = time.time() - t0
    seqs = read_sequences(a.tokens)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    warm, timed = seqs[: a.warmup], seqs[a.warmup :] or seqs
    if warm:
        llm.generate([TokensPrompt(prompt_token_ids=s) for s in warm], params, use_tqdm=False)
    t1 = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=s) for s in timed], params, use_tqdm=False)
    seconds = time.perf_counter() - t1
    n = sum(map(len, timed))
    say(
        {
            "ok": True,
            "plain_prefill_tokens_per_s": n / seconds,
            "tokens": n,
            "seconds": seconds,
            "start_s": round(start_s, 1),
        }
    )


def main():
    argv = sys.argv[1:]
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["capture", "prefill"])
    ap.add_argument("--target", required=True)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--layers", help="vLLM aux ids, comma-separated (capture)")
    ap.add_argument("--work", help="folder for the connector's files (capture)")
    ap.add_argument("--tokens", help="sequences to time (prefill)")
    ap.add_argument("--warmup", type=int, default=1)
    a = ap.parse_args(argv)
    try:
        (capture if a.mode == "capture" else prefill)(a, flags)
    except BaseException as e:
        import traceback

        traceback.print_exc()
        say({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
