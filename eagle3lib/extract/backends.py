"""01_extract's backends (extract.backend: hf | vllm | sglang | sglang_inprocess) behind the few calls the stage notebook makes.

    s = backends.setup(p)                                # target folder, aux ids, contract (+ the model for hf)
    capture = backends.make_capture(p, s, log_dir=out)
    with capture:                                        # an engine may stay up across the splits
        r = shards.extract_with(capture, tokens, s["aux_ids"], out / split, s["contract"], ...)
    tps = backends.plain_prefill_tokens_per_s(p, s, capture, tokens, r, log_dir=out)

hf loads the target here (the reference); the engine backends never do: a Kimi-sized target does not fit
one process, so they read its config and tokenizer only and the engine loads the weights. The engine
section of the params (python, extra_args, env, host, port, start_timeout_s) applies to the extraction
engine when engine.name is the same engine; otherwise that engine's defaults are used (.venv-<engine>).
Whatever the backend: the same shards, manifest, contract and HF hidden_states ids (docs/design.md §4).
"""

from __future__ import annotations

from eagle3lib import params as P
from eagle3lib import target
from eagle3lib.engines.interpreter import engine_python
from eagle3lib.extract import hf, shards


def setup(p) -> dict:
    """{backend, target_dir, aux_ids, tokenizer, model (hf only, else None), contract} for the params."""
    backend = p.extract.backend
    cache = P.cache_dir(p)
    if backend == "hf":
        model, tokenizer = target.load_target(
            p.target.name,
            cache,
            dtype=p.target.dtype,
            device=p.target.device,
            trust_remote_code=p.target.trust_remote_code,
        )
        config, target_dir = model.config, None
    else:
        target_dir = target.resolve_target(p.target.name, cache)
        target.target_config_json(target_dir)  # a local folder: the engine and we read the same files
        info, tokenizer = target.load_target_info(target_dir, cache, trust_remote_code=p.target.trust_remote_code)
        config, model = info.config, None
    layers = target.num_layers(config)
    aux_ids = target.aux_layer_ids(p.target.aux_layer_ids, layers)
    # make_contract reads only model.config: an engine backend passes the weights-free view
    contract = target.make_contract(
        p.target.name, model if model is not None else info, tokenizer, aux_ids, p.extract.store_dtype
    )
    return {
        "backend": backend,
        "target_dir": target_dir,
        "aux_ids": aux_ids,
        "tokenizer": tokenizer,
        "model": model,
        "contract": contract,
    }


def engine_settings(p, engine: str) -> dict:
    """python, extra_args, env, host, port, start_timeout_s for `engine` from the params' engine section."""
    same = p.engine.name == engine
    return {
        "python": engine_python(engine, p.engine.python if same else None),
        "extra_args": list(p.engine.extra_args) if same else [],
        "env": dict(p.engine.env) if same else {},
        "host": p.engine.host,
        "port": p.engine.port if same else None,
        "start_timeout_s": p.engine.start_timeout_s,
    }


def make_capture(p, s: dict, log_dir=None):
    """The backend's shards.Capture (hf.HFCapture / vllm.VLLMCapture / sglang.SGLangCapture), or for
    sglang_inprocess the handle that runs extract_with inside SGLang's interpreter (SGLangInProcess)."""
    backend = p.extract.backend
    if backend == "hf":
        return hf.HFCapture(s["model"], s["aux_ids"], p.extract.batch_tokens)
    engine = "sglang" if backend == "sglang_inprocess" else backend
    e = engine_settings(p, engine)
    if e["python"] is None:
        raise FileNotFoundError(
            f"extract.backend is {backend!r} but no interpreter with {engine} was found: set "
            f"engine.name: {engine} and engine.python, or build .venv-{engine} (make {engine}-env)"
        )
    if backend == "sglang_inprocess":
        from eagle3lib.extract.sglang_inprocess import SGLangInProcess

        return SGLangInProcess(
            s["target_dir"],
            s["aux_ids"],
            python=e["python"],
            dtype=p.target.dtype,
            extra_args=e["extra_args"],
            env=e["env"],
            log_dir=log_dir,
            batch_tokens=p.extract.batch_tokens,
            plain_batches=p.extract.forward_benchmark_batches,
        )
    if backend == "vllm":
        from eagle3lib.extract.vllm import VLLMCapture

        flags = list(e["extra_args"])
        if "--max-model-len" not in flags:  # prompt (<= data.max_seq_len) + the one generated token
            flags += ["--max-model-len", str(p.data.max_seq_len + 16)]
        return VLLMCapture(
            s["target_dir"],
            s["aux_ids"],
            dtype=p.target.dtype,
            python=e["python"],
            extra_args=flags,
            env=e["env"],
            log_dir=log_dir,
            prefill_benchmark_batches=p.extract.forward_benchmark_batches,
            batch_tokens=p.extract.batch_tokens,
            timeout_s=e["start_timeout_s"],
        )
    from eagle3lib.extract.sglang import SGLangCapture

    return SGLangCapture(
        s["target_dir"],
        s["aux_ids"],
        batch_tokens=p.extract.batch_tokens,
        dtype=p.target.dtype,
        python=e["python"],
        extra_args=e["extra_args"],
        host=e["host"],
        port=e["port"],
        start_timeout_s=e["start_timeout_s"],
        env=e["env"],
        log_dir=log_dir,
        prefill_benchmark_batches=p.extract.forward_benchmark_batches,
    )


def plain_prefill_tokens_per_s(p, s: dict, capture, tokens, result: dict | None, log_dir=None):
    """What the capture rate is compared with: hf, the target's plain forward on the first batches (no hooks,
    no writes); an engine, the same engine's plain prefill (no hidden states asked), taken from the
    extraction's result when it measured it, else measured now. None when there is nothing to time."""
    n = p.extract.forward_benchmark_batches
    batches = list(hf.iter_batches(tokens, p.extract.batch_tokens, p.extract.shard_max_tokens))[: n + 1]
    if not n or not batches:
        return None
    if p.extract.backend == "hf":
        return hf.measure_forward_tokens_per_s(s["model"], batches[:n])
    if result and result.get("plain_prefill_tokens_per_s"):
        return result["plain_prefill_tokens_per_s"]
    if len(batches) < 2 or p.extract.backend == "sglang_inprocess":  # it measures inside its own run or not at all
        return None
        return None
    tok = shards.as_token_tensors(tokens)
    seqs = [q for b in batches for q in b[0]]
    if p.extract.backend == "vllm":
        return capture.measure_plain_prefill(tok, seqs, len(batches[0][0]), log_dir or ".")[
            "plain_prefill_tokens_per_s"
        ]
    return capture.measure_plain_prefill(tok, seqs, log_dir or ".")
