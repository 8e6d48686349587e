"""01_extract's backends (extract.backend: hf | vllm | sglang | sglang_inprocess), chosen once: make_capture returns
the Backend the params name, and the stage notebook's calls go to it whatever it is.

    s = backends.setup(p)                                # target folder, aux ids, contract (+ the model for hf)
    capture = backends.make_capture(p, s, log_dir=out)   # a Backend
    results = capture.extract_splits({"train": (prep / "train.safetensors", out / "train"), ...})
    tps = capture.plain_prefill_tokens_per_s(tokens, results["train"], log_dir=out)

hf, vllm and sglang are shards.Captures that extract_with drives from this process (the engine ones run their
engine as a subprocess); sglang_inprocess runs extract_with itself in SGLang's interpreter
(sglang_inprocess_extract.SGLangInProcess). hf loads the target here (the reference); the engine backends never
do: a Kimi-sized target does not fit one process, so they read its config and tokenizer only and the engine loads
the weights. The engine section of the params (python, extra_args, env, host, port, start_timeout_s) applies to
the extraction engine when engine.name is the same engine; otherwise that engine's defaults are used
(.venv-<engine>). Whatever the backend: the same shards, manifest, contract and HF hidden_states ids
(docs/design.md §4).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from eagle3lib import params as P
from eagle3lib import target
from eagle3lib.engines.interpreter import engine_python
from eagle3lib.extract import hf, shards
from eagle3lib.prepare import conversations


class Backend(Protocol):
    """What make_capture returns: the backend as the 01_extract notebook uses it."""

    name: str

    def extract_splits(self, splits: dict[str, tuple[Path, Path]], budget=None) -> dict[str, dict]:
        """{split: (tokens file, out dir)} -> {split: extract_with's result}; the target loads once for all.
        budget: a sizing.ExtractBudget (extract.max_minutes), which orders the splits and cuts their tokens."""

    def plain_prefill_tokens_per_s(self, tokens, result: dict | None, log_dir=None) -> float | None:
        """What the capture rate is compared with, on the first batches of `tokens` (result: the extraction's of
        them); None when there is nothing to time."""


@dataclass(frozen=True)
class ExtractSettings:
    """What extract_with is called with, from the params and setup()."""

    aux_ids: list[int]
    contract: dict
    layout: shards.ShardLayout
    plain_batches: int  # extract.forward_benchmark_batches: timed batches of the plain prefill

    @classmethod
    def of(cls, p, s: dict) -> ExtractSettings:
        e = p.extract
        layout = shards.ShardLayout(target.torch_dtype(e.store_dtype), e.shard_max_tokens, e.batch_tokens)
        return cls(s["aux_ids"], s["contract"], layout, e.forward_benchmark_batches)

    def first_batches(self, tokens) -> list:
        """The plain prefill's batches of `tokens` (the hf backend's, one more than plain_batches; none when 0)."""
        if not self.plain_batches:
            return []
        batches = hf.iter_batches(tokens, self.layout.batch_tokens, self.layout.shard_max_tokens)
        return list(batches)[: self.plain_batches + 1]


class ExtractHere:
    """A backend whose shards.Capture extract_with drives from this process: every split through it, one after
    the other with the capture open once (an engine that can stays up for all splits)."""

    def __init__(self, capture: shards.Capture, settings: ExtractSettings):
        self.capture, self.settings, self.name = capture, settings, capture.name

    def extract_splits(self, splits: dict[str, tuple[Path, Path]], budget=None) -> dict[str, dict]:
        st, results = self.settings, {}
        with self.capture:
            for split in budget.order(list(splits)) if budget else splits:
                tokens_file, out_dir = splits[split]
                tokens = conversations.load_tokens(tokens_file)
                tokens = budget.cut(split, tokens, results) if budget else tokens
                results[split] = shards.extract_with(self.capture, tokens, st.aux_ids, out_dir, st.contract, st.layout)
        return results


class HFBackend(ExtractHere):
    """hf: the Hugging Face model loaded in this process (the reference)."""

    def plain_prefill_tokens_per_s(self, tokens, result: dict | None, log_dir=None) -> float | None:
        """The target's plain forward (no hooks, no writes) on the first batches, measured now."""
        batches = self.settings.first_batches(tokens)
        if not batches:
            return None
        return hf.measure_forward_tokens_per_s(self.capture.model, batches[: self.settings.plain_batches])


class EngineBackend(ExtractHere, ABC):
    """vllm, sglang: the engine's plain prefill (no hidden states asked), by the engine's own measurement."""

    @abstractmethod
    def engine_plain_prefill(self, tok, seq_ids, warmup: int, log_dir) -> float | None:
        """Tokens/s of the engine's plain prefill of these sequences (the first `warmup` of them untimed)."""

    def plain_prefill_tokens_per_s(self, tokens, result: dict | None, log_dir=None) -> float | None:
        """The extraction's own figure when it measured one, else measured now (the first batch untimed)."""
        batches = self.settings.first_batches(tokens)
        if not batches:
            return None
        if result and result.get("plain_prefill_tokens_per_s"):
            return result["plain_prefill_tokens_per_s"]
        if len(batches) < 2:
            return None
        tok, first = shards.as_token_tensors(tokens), len(batches[0][0])
        return self.engine_plain_prefill(tok, [q for b in batches for q in b[0]], first, log_dir or ".")


class VLLMBackend(EngineBackend):
    """vllm: VLLMCapture, vLLM in its interpreter."""

    def engine_plain_prefill(self, tok, seq_ids, warmup: int, log_dir) -> float:
        return self.capture.measure_plain_prefill(tok, seq_ids, warmup, log_dir)["plain_prefill_tokens_per_s"]


class SGLangBackend(EngineBackend):
    """sglang: SGLangCapture, the client of its two SGLang servers."""

    def engine_plain_prefill(self, tok, seq_ids, warmup: int, log_dir) -> float | None:
        return self.capture.measure_plain_prefill(tok, seq_ids, log_dir)  # its first batch is the warm-up


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


def make_capture(p, s: dict, log_dir=None) -> Backend:
    """The Backend extract.backend names: HFBackend, VLLMBackend or SGLangBackend over the backend's shards.Capture
    (hf.HFCapture / vllm.VLLMCapture / sglang.SGLangCapture), or sglang_inprocess's SGLangInProcess."""
    backend, settings = p.extract.backend, ExtractSettings.of(p, s)
    if backend == "hf":
        return HFBackend(hf.HFCapture(s["model"], s["aux_ids"], p.extract.batch_tokens), settings)
    engine = "sglang" if backend == "sglang_inprocess" else backend
    e = engine_settings(p, engine)
    if e["python"] is None:
        raise FileNotFoundError(
            f"extract.backend is {backend!r} but no interpreter with {engine} was found: set "
            f"engine.name: {engine} and engine.python, or build .venv-{engine} (make {engine}-env)"
        )
    if backend == "sglang_inprocess":
        from eagle3lib.extract.sglang_inprocess_extract import SGLangInProcess

        return SGLangInProcess(
            s["target_dir"],
            s["aux_ids"],
            python=e["python"],
            contract=s["contract"],
            store_dtype=p.extract.store_dtype,
            shard_max_tokens=p.extract.shard_max_tokens,
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
        capture = VLLMCapture(
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
        return VLLMBackend(capture, settings)
    from eagle3lib.extract.sglang import SGLangCapture

    capture = SGLangCapture(
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
    return SGLangBackend(capture, settings)
