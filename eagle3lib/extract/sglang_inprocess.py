"""The sglang_inprocess backend of 01_extract: SGLang's own model runner in the extracting process, one prefill per
token, the states from the GPU straight into shards.extract_with (GPU hosts).

The server backend (extract/sglang.py) gets the states as JSON floats and prefills every token twice; this one
loads the target the way SGLang's own one-batch benchmark does (sglang.benchmark.one_batch: load_model, extend)
and reads both kinds of state from one forward:
- aux: the model captures the layers named by set_eagle3_layers_to_capture(ids), the call SGLang's EAGLE-3 target
  makes; ids = engines.sglang.sglang_config_ids(ours, architecture), the export's rule, and the layers the model
  then captures are read back and must be ours (HF hidden_states indices);
- final: the model hands its logits processor the final normed state of every token of an extend batch; a
  forward pre-hook on that module takes it, together with the aux states it is handed beside it.
Batches are consecutive sequences up to extract.batch_tokens tokens (ragged, no padding), so a shard's rows come
out in token order; the KV pools are cleared after each batch. The states are cast, or quantized to fp8, on the
GPU (shards.store_states) and copied into the shard's host buffers. Tensor parallel: one process a GPU; rank 0
runs extract_with here and ranks 1.. (spawned) run every batch rank 0 broadcasts on the TP group's CPU group.
Its plain prefill is the same extend() on the same first batches with the capture off.

This module runs in SGLang's interpreter (engine.python), started by SGLangInProcess from the notebook's:
    python -m eagle3lib.extract.sglang_inprocess extract --target DIR --aux-layer-ids 2,15,27 --contract FILE \\
        --split train=PREP/train.safetensors:OUT/train [--split ...] [--store-dtype D] [-- SGLANG FLAGS]
and as the GPU check against hf (per layer, the layer probe, capture over plain prefill):
    python -m eagle3lib.extract.sglang_inprocess compare --target DIR --tokens FILE --out DIR [-- SGLANG FLAGS]
Protocol lines on stdout start with "@@eagle3lib "; everything else is SGLang's log.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from eagle3lib.drafter.aux_ids import sglang_config_ids
from eagle3lib.extract import shards
from eagle3lib.target.config import target_config_json

PREFIX = "@@eagle3lib "
# Not needed for extend batches, and capturing decode graphs costs a minute at start-up.
DEFAULT_FLAGS = ["--disable-cuda-graph"]


class InProcessError(RuntimeError):
    """SGLang's model runner did not give the states this backend needs."""


# ------------------------------------------------------------------------------ CPU parts ----


def pack_batches(lengths, first: int, end: int, batch_tokens: int) -> list[tuple[int, int]]:
    """Consecutive sequence ranges [a, b) within [first, end) of at most batch_tokens tokens each (a longer
    sequence goes alone): concatenated in order, a batch's rows are its tokens in order."""
    out, start, used = [], first, 0
    for s in range(first, end):
        n = int(lengths[s])
        if s > start and used + n > batch_tokens:
            out.append((start, s))
            start, used = s, 0
        used += n
    if start < end:
        out.append((start, end))
    return out


def check_captured(captured, aux_layer_ids, architecture: str) -> None:
    """The layers SGLang's model captures after set_eagle3_layers_to_capture must be ours: its layers_to_capture
    holds i for 'the input of layer i' = HF hidden_states[i], our convention."""
    if [int(i) for i in captured] != [int(i) for i in aux_layer_ids]:
        raise InProcessError(
            f"SGLang's {architecture} captures layers {list(captured)} for config ids "
            f"{sglang_config_ids(aux_layer_ids, architecture)}, expected our aux ids {list(aux_layer_ids)}; the id rule "
            f"in engines/sglang.py does not hold for this SGLang release or architecture"
        )


def causal_lm(model):
    """The module that holds the decoder (`.model.layers_to_capture`) and the logits processor: the model itself, or
    a wrapper's `language_model` (Kimi-K2.5's KimiK25ForConditionalGeneration around DeepseekV3ForCausalLM)."""
    for m in (model, getattr(model, "language_model", None)):
        if m is not None and hasattr(m, "logits_processor") and hasattr(getattr(m, "model", None), "layers_to_capture"):
            return m
    raise InProcessError(
        f"{type(model).__name__} has no logits_processor beside a decoder with layers_to_capture (nor has its "
        f"language_model): SGLang's EAGLE-3 capture is not built for this architecture; use extract.backend: sglang"
    )


def logits_processor_states(forward, args, kwargs) -> tuple:
    """(final normed hidden_states [T, H], aux_hidden_states list) from the arguments a logits processor was
    called with, by its forward's parameter names (positional or keyword)."""
    bound = inspect.signature(forward).bind(*args, **kwargs)
    return bound.arguments.get("hidden_states"), bound.arguments.get("aux_hidden_states")


class ShardBuffers:
    """A shard's stored tensors on the host, filled batch by batch at token offsets (pinned on CUDA hosts, so the
    copies from the GPU are asynchronous)."""

    def __init__(self, n: int, hidden: int, n_aux: int, store_dtype, pin: bool):
        fp8 = store_dtype == shards.FP8
        shapes = {"aux_hidden": (n, n_aux * hidden, store_dtype), "final_hidden": (n, hidden, store_dtype)}
        if fp8:
            shapes |= {"aux_scale": (n, n_aux, torch.float32), "final_scale": (n, 1, torch.float32)}
        self.tensors = {k: torch.empty(r, c, dtype=d, pin_memory=pin) for k, (r, c, d) in shapes.items()}

    def put(self, at: int, stored: dict) -> int:
        n = 0
        for k, v in stored.items():
            n = v.shape[0]
            self.tensors[k][at : at + n].copy_(v, non_blocking=True)
        return n


# ------------------------------------------------------------------------------ the runner ----


def server_args_from_flags(target_dir, dtype, flags):
    """sglang ServerArgs from launch_server's own flags (what --tp, --mem-fraction-static, --load-format... mean)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    argv = ["--model-path", str(target_dir)] + (["--dtype", dtype] if dtype else [])
    argv += [f for f in DEFAULT_FLAGS if f not in flags] + list(flags)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


class Runner:
    """SGLang's model runner of one TP rank, with the states captured from its logits processor."""

    def __init__(self, server_args, port_args, gpu_id: int, tp_rank: int, aux_layer_ids, architecture: str):
        from sglang.benchmark import one_batch
        from sglang.srt.layers.moe import initialize_moe_config
        from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
        from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config

        initialize_moe_config(server_args)  # as one_batch's latency_test does before load_model
        initialize_fp8_gemm_config(server_args)
        initialize_fp4_gemm_config(server_args)
        self.one_batch, self.tp_rank = one_batch, tp_rank
        bench, _ = one_batch.load_model(server_args, port_args, gpu_id, tp_rank)
        self.runner = bench.torch_runner
        self.tp_group = self.runner.tp_group
        self.runner.model.set_eagle3_layers_to_capture(sglang_config_ids(aux_layer_ids, architecture))
        self.model = causal_lm(self.runner.model)  # a wrapper delegates the call above to it
        check_captured(self.model.model.layers_to_capture, aux_layer_ids, architecture)
        self._capture_layers = list(self.model.model.layers_to_capture)
        self._seen = None
        processor = self.model.logits_processor
        self._hook = processor.register_forward_pre_hook(self._take, with_kwargs=True)
        self._forward = processor.forward

    def _take(self, module, args, kwargs):
        if self._seen is not None:
            final, aux = logits_processor_states(self._forward, args, kwargs)
            self._seen.update(final=final, aux=aux)

    def set_capture(self, on: bool) -> None:
        """Aux capture on (as configured) or off (a plain prefill)."""
        self.model.capture_aux_hidden_states = on
        self.model.model.layers_to_capture = list(self._capture_layers) if on else []

    @torch.no_grad()
    def extend(self, seqs: list[list[int]], capture: bool):
        """One prefill of these sequences; with capture, (aux [T, k*H], final [T, H]) on the GPU in token order."""
        reqs = self.one_batch.prepare_synthetic_inputs_for_latency_test(len(seqs), 0, custom_inputs=seqs)
        self.set_capture(capture)
        self._seen = {} if capture else None
        try:
            self.one_batch.extend(reqs, self.runner)
            if not capture:
                return None
            final, aux = self._seen.get("final"), self._seen.get("aux")
        finally:
            self._seen = None
            self.runner.req_to_token_pool.clear()
            self.runner.token_to_kv_pool_allocator.clear()
        n = sum(len(s) for s in seqs)
        if final is None or not aux or final.shape[0] != n or any(a.shape[0] != n for a in aux):
            raise InProcessError(
                f"the logits processor was handed final {None if final is None else tuple(final.shape)} and "
                f"{len(aux or [])} aux states for a batch of {n} tokens; expected [{n}, H] and one [{n}, H] per "
                f"aux layer (an SGLang release whose model forward differs from 0.5.17's?)"
            )
        return torch.cat(aux, dim=-1), final

    def broadcast(self, message):
        """Rank 0: send a message to the other ranks; others: receive it."""
        return self.tp_group.broadcast_object(message, src=0)

    def close(self):
        self._hook.remove()


def _follow(server_args, port_args, gpu_id, tp_rank, aux_layer_ids, architecture):
    """Ranks 1..: run every batch rank 0 runs, until it says stop."""
    runner = Runner(server_args, port_args, gpu_id, tp_rank, aux_layer_ids, architecture)
    while True:
        message = runner.broadcast(None)
        if message is None:
            return
        runner.extend(message["seqs"], message["capture"])


class Engine:
    """Rank 0 here, ranks 1.. spawned; extend() runs a batch on all of them."""

    def __init__(self, target_dir, aux_layer_ids, dtype=None, flags=()):
        import multiprocessing

        from sglang.srt.entrypoints.engine import _set_envs_and_config
        from sglang.srt.server_args import PortArgs

        _, self.architecture = target_config_json(target_dir)
        self.server_args = server_args_from_flags(target_dir, dtype, list(flags))
        _set_envs_and_config(self.server_args)
        port_args = PortArgs.init_new(self.server_args)
        t0 = time.perf_counter()
        ctx = multiprocessing.get_context("spawn")
        args = (self.server_args, port_args)
        self.followers = [
            ctx.Process(target=_follow, args=(*args, r, r, aux_layer_ids, self.architecture), daemon=True)
            for r in range(1, self.server_args.tp_size)
        ]
        for p in self.followers:
            p.start()
        self.runner = Runner(*args, 0, 0, aux_layer_ids, self.architecture)
        self.start_s = time.perf_counter() - t0

    def extend(self, seqs, capture: bool):
        if self.followers:
            self.runner.broadcast({"seqs": seqs, "capture": capture})
        return self.runner.extend(seqs, capture)

    def close(self):
        if self.followers:
            self.runner.broadcast(None)
            for p in self.followers:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
        self.runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def split_states(aux, final, lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A ragged batch's states [T, .] (on the GPU, in token order) as (aux [n, k*H], final [n, H]) on the host per
    sequence of these lengths: one copy of each, then views."""
    aux, final = aux.to("cpu", copy=True), final.to("cpu", copy=True)
    return list(zip(aux.split(lengths), final.split(lengths), strict=True))


class EngineStates:
    """Online training's StateSource (train/online.py) over an Engine: one extend() of consecutive sequences, packed
    without padding, their states handed to the trainer on the host (as the hf source hands them)."""

    name = "sglang_inprocess"
    ragged = True

    def __init__(self, engine: Engine, batch_tokens: int):
        self.engine, self.batch_tokens = engine, int(batch_tokens)
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def capture(self, sequences: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.device is not None:  # the current GPU is per thread: the capture thread's is not set
            torch.cuda.set_device(self.device)
        aux, final = self.engine.extend([s.tolist() for s in sequences], capture=True)
        return split_states(aux, final, [len(s) for s in sequences])

    def close(self) -> None:
        self.engine.close()


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class InProcessCapture:
    """A shards.Capture over an Engine: each shard's states, stored (cast or fp8) on the GPU."""

    name = "sglang_inprocess"

    def __init__(
        self, engine: Engine, hidden_size, vocab_size, aux_layer_ids, store_dtype, batch_tokens, plain_batches
    ):
        self.engine, self.hidden_size, self.vocab_size = engine, int(hidden_size), int(vocab_size)
        self.n_aux, self.store_dtype = len(aux_layer_ids), store_dtype
        self.batch_tokens, self.plain_batches = batch_tokens, plain_batches
        self._stats = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def _seqs(self, tok, a, b):
        starts = tok["seq_starts"]
        return [tok["input_ids"][int(starts[s]) : int(starts[s + 1])].tolist() for s in range(a, b)]

    def plain_prefill(self, tok, lengths, plan) -> float | None:
        """Tokens/s of the same engine's extend() with the capture off, on the first batches (one untimed)."""
        batches = [r for a, b in plan for r in pack_batches(lengths, a, b, self.batch_tokens)]
        batches = batches[: self.plain_batches + 1]
        if len(batches) < 2:
            return None
        self.engine.extend(self._seqs(tok, *batches[0]), capture=False)
        _sync()
        t0, n = time.perf_counter(), 0
        for a, b in batches[1:]:
            seqs = self._seqs(tok, a, b)
            self.engine.extend(seqs, capture=False)
            n += sum(len(s) for s in seqs)
        _sync()
        return n / (time.perf_counter() - t0)

    @contextlib.contextmanager
    def session(self, tok, lengths, plan, out_dir):
        t0 = time.perf_counter()
        self._stats = {"engine_start_s": round(self.engine.start_s, 1), "passes": 1}
        self._stats["plain_prefill_tokens_per_s"] = self.plain_prefill(tok, lengths, plan)
        self._stats["excluded_s"] = time.perf_counter() - t0  # the plain prefill is not capture time
        yield self

    def shard(self, tok, lengths, first, end, dtype, bar):
        n = int(tok["seq_starts"][end] - tok["seq_starts"][first])
        cuda = torch.cuda.is_available()
        out = ShardBuffers(n, self.hidden_size, self.n_aux, self.store_dtype, pin=cuda)
        # the copies to the host run on their own stream, beside the next batch's forward
        copies = torch.cuda.Stream() if cuda else None
        at = 0
        for a, b in pack_batches(lengths, first, end, self.batch_tokens):
            aux, final = self.engine.extend(self._seqs(tok, a, b), capture=True)
            stored = shards.store_states(aux, final, self.n_aux, self.store_dtype)
            if copies is None:
                at += out.put(at, stored)
            else:
                copies.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(copies):
                    at += out.put(at, stored)
                for v in stored.values():  # not reused by the allocator before the copy has read it
                    v.record_stream(copies)
            bar.update(int(tok["seq_starts"][b] - tok["seq_starts"][a]))
        _sync()  # the host copies are done before the writer thread reads them
        return out.tensors

    def stats(self):
        return dict(self._stats)


# --------------------------------------------------------------------- the notebook's side ----


def _say(obj):
    sys.stdout.write(PREFIX + json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


@dataclass
class SGLangInProcess:
    """The notebook's handle on the backend: runs this module in SGLang's interpreter over every split (the model
    loads once) and returns {split: extract_with's result}. A failure raises with the log's last lines."""

    target_dir: str
    aux_layer_ids: list[int]
    python: str
    dtype: str | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict | None = None
    log_dir: str | None = None
    batch_tokens: int = 16384
    plain_batches: int = 4
    name: ClassVar[str] = "sglang_inprocess"

    def __post_init__(self):
        self.target_dir, self.aux_layer_ids = str(self.target_dir), list(self.aux_layer_ids)
        self.extra_args, self.env = list(self.extra_args), dict(self.env or {})

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def command(self, splits: dict, contract_file, store_dtype: str, shard_max_tokens: int) -> list[str]:
        cmd = [self.python, "-m", __name__, "extract", "--target", self.target_dir, "--contract", str(contract_file)]
        cmd += ["--aux-layer-ids", ",".join(map(str, self.aux_layer_ids)), "--store-dtype", store_dtype]
        cmd += ["--batch-tokens", str(self.batch_tokens), "--shard-max-tokens", str(shard_max_tokens)]
        cmd += ["--plain-batches", str(self.plain_batches)] + (["--dtype", self.dtype] if self.dtype else [])
        for name, (tokens, out) in splits.items():
            cmd += ["--split", f"{name}={tokens}:{out}"]
        return cmd + ["--"] + self.extra_args

    def extract_splits(self, splits: dict, contract: dict, store_dtype: str, shard_max_tokens: int) -> dict:
        """splits: {name: (tokens file, out dir)} -> {name: result}."""
        log_dir = Path(self.log_dir or next(iter(splits.values()))[1]).resolve()
        log_dir.mkdir(parents=True, exist_ok=True)
        contract_file = log_dir / "sglang-inprocess-contract.json"
        contract_file.write_text(json.dumps(contract))
        root = str(Path(__file__).resolve().parents[2])  # so that SGLang's interpreter imports this eagle3lib
        env = dict(os.environ, **self.env)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        log = log_dir / "sglang-inprocess.log"
        cmd = self.command(splits, contract_file, store_dtype, shard_max_tokens)
        results = {}
        with open(log, "w") as f, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env=env) as proc:
            for line in proc.stdout:
                if line.startswith(PREFIX):
                    msg = json.loads(line[len(PREFIX) :])
                    if "split" in msg:
                        results[msg["split"]] = msg["result"]
                    print(f"sglang_inprocess: {msg}", flush=True)
                else:
                    f.write(line)
            code = proc.wait()
        if code != 0 or set(results) != set(splits):
            tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
            raise InProcessError(
                f"the sglang_inprocess extraction exited {code} with splits {sorted(results)} of {sorted(splits)} "
                f"done (their shards are kept and resume); command: {' '.join(cmd)}\nlast lines of {log}:\n{tail}"
            )
        return results


# ------------------------------------------------------------------------------ entry points ----


def _parse(argv):
    ap = argparse.ArgumentParser(description="sglang_inprocess extraction (runs in SGLang's interpreter)")
    ap.add_argument("command", choices=["extract", "compare"])
    ap.add_argument("--target", required=True)
    ap.add_argument("--aux-layer-ids", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--contract", help="extract: the target contract (JSON file) the shards carry")
    ap.add_argument("--split", action="append", default=[], help="extract: NAME=TOKENS_FILE:OUT_DIR")
    ap.add_argument("--tokens", help="compare: token arrays (data.save_tokens format)")
    ap.add_argument("--out", default="/tmp/eagle3-inprocess-check", help="compare: output folder")
    ap.add_argument("--n", type=int, default=10**9, help="compare: at most this many sequences")
    ap.add_argument("--store-dtype", default="bfloat16")
    ap.add_argument("--dtype", default=None, help="SGLang's --dtype")
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--shard-max-tokens", type=int, default=None, help="default: about 1 GiB a shard")
    ap.add_argument("--plain-batches", type=int, default=4)
    ap.add_argument("--writers", type=int, default=2, help="shards written at once (threads)")
    ap.add_argument("--no-reference", action="store_true", help="compare: skip hf (a target too big for one GPU)")
    if "--" in argv:
        i = argv.index("--")
        return ap.parse_args(argv[:i]), argv[i + 1 :]
    return ap.parse_args(argv), []


def _capture(engine, text, aux_ids, a):
    from eagle3lib.target import torch_dtype

    return InProcessCapture(
        engine,
        text["hidden_size"],
        text["vocab_size"],
        aux_ids,
        torch_dtype(a.store_dtype),
        a.batch_tokens,
        a.plain_batches,
    )


def _extract_main(a, flags):
    from eagle3lib.prepare.conversations import load_tokens
    from eagle3lib.target import torch_dtype

    contract = json.loads(Path(a.contract).read_text())
    aux_ids = a.aux_layer_ids or contract["aux_layer_ids"]
    text, _ = target_config_json(a.target)
    with Engine(a.target, aux_ids, a.dtype, flags) as engine:
        _say({"engine_start_s": round(engine.start_s, 1), "tp": engine.server_args.tp_size})
        for spec in a.split:
            name, rest = spec.split("=", 1)
            tokens_file, out = rest.rsplit(":", 1)
            r = shards.extract_with(
                _capture(engine, text, aux_ids, a),
                load_tokens(tokens_file),
                aux_ids,
                out,
                contract,
                batch_tokens=a.batch_tokens,
                shard_max_tokens=a.shard_max_tokens,
                store_dtype=torch_dtype(a.store_dtype),
                progress=False,
            )
            _say({"split": name, "result": r})
    return 0


def _compare_main(a, flags):
    """Extract --tokens in process; against hf on the same tokens unless --no-reference; print a JSON report."""
    import shutil

    from eagle3lib import target
    from eagle3lib.extract import compare, hf
    from eagle3lib.prepare.conversations import load_tokens

    text, arch = target_config_json(a.target)
    aux_ids = a.aux_layer_ids or target.aux_layer_ids(None, int(text["num_hidden_layers"]))
    tokens = load_tokens(a.tokens)
    n = min(a.n, tokens["seq_starts"].numel() - 1)
    end = int(tokens["seq_starts"][n])
    tokens = {"input_ids": tokens["input_ids"][:end], "loss_mask": tokens["loss_mask"][:end]} | {
        "seq_starts": tokens["seq_starts"][: n + 1]
    }
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    contract = {"target": a.target, "aux_layer_ids": aux_ids, "hidden_size": int(text["hidden_size"])}
    kw = dict(batch_tokens=a.batch_tokens, shard_max_tokens=a.shard_max_tokens, progress=False)
    store = target.torch_dtype(a.store_dtype)
    report = {"target": a.target, "architecture": arch, "aux_layer_ids": aux_ids, "sequences": n, "tokens": end}
    report["writers"] = a.writers
    with Engine(a.target, aux_ids, a.dtype, flags) as engine:
        report["tp"] = engine.server_args.tp_size
        cap = _capture(engine, text, aux_ids, a)
        r = shards.extract_with(
            cap, tokens, aux_ids, str(out / "inprocess"), contract, store_dtype=store, writers=a.writers, **kw
        )
    keep = ("tokens_per_s", "seconds", "engine_start_s", "plain_prefill_tokens_per_s", "bytes_per_token", "shards")
    keep += ("capture_s", "write_wait_s")
    report["inprocess"] = {k: r.get(k) for k in keep}
    pp = r.get("plain_prefill_tokens_per_s")
    report["inprocess"]["capture_over_plain_prefill"] = r["tokens_per_s"] / pp if pp and r.get("tokens_per_s") else None
    report["ok"] = True
    if not a.no_reference:
        model, _ = target.load_target(a.target, Path(out), dtype=a.dtype or "bfloat16", device="cuda")
        hf.extract(model, tokens, aux_ids, str(out / "hf"), contract, store_dtype=store, **kw)
        head = model.lm_head.weight.detach()
        report["agreement"] = compare.compare_shard_sets(str(out / "inprocess"), str(out / "hf"), lm_head=head)
        report["layer_probe"] = compare.layer_probe(model, str(out / "inprocess"), aux_ids, max_sequences=8)
        report["ok"] = bool(report["agreement"]["ok"] and report["layer_probe"]["ok"])
    text_out = json.dumps(report, indent=1, default=str)
    (out / "compare.json").write_text(text_out + "\n")
    _say({"report": str(out / "compare.json"), "ok": report["ok"]})
    print(text_out, flush=True)
    return 0 if report["ok"] else 1


def main(argv=None):
    a, flags = _parse(list(sys.argv[1:] if argv is None else argv))
    if a.command == "extract":
        if not a.contract or not a.split:
            raise SystemExit("extract needs --contract FILE and at least one --split NAME=TOKENS_FILE:OUT_DIR")
        return _extract_main(a, flags)
    if not a.tokens:
        raise SystemExit("compare needs --tokens FILE (python -m eagle3lib.extract.sglang --save-tokens makes one)")
    return _compare_main(a, flags)


if __name__ == "__main__":
    sys.exit(main())
