"""The vllm backend of 01_extract: hidden states through vLLM's `extract_hidden_states` speculative method.

This is how the speculators project generates offline EAGLE-3 data, and vLLM's tensor parallelism comes
with it (pass --tensor-parallel-size in engine.extra_args on GPUs). vLLM runs in its own interpreter
(engine.python, default .venv-vllm), so the capture runs there as a subprocess, eagle3lib/engines/engine_side/vllm_capture.py,
one per extraction call: it starts vllm.LLM once and then captures shard after shard on request (one JSON
line each way; token ids in and hidden states out through files in the stage's folder). The shards are
written here by shards.extract_with, the same writer, manifest, contract and resume as the hf backend.

What vLLM 0.32.0 returns and how it maps to ours (read in its source):
- `speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
  "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}}`: the target's model
  runner captures those layers (vLLM id = HF hidden_states index, our convention: no translation) and the
  ExtractHiddenStatesModel puts them in a cache-only KV layer; the hidden-states connector writes each
  finished request's rows [T, len(ids), H], in ascending id order, to a safetensors file.
- We ask for our aux ids plus L (the number of layers). vLLM's id L is the residual stream after the last
  layer, BEFORE the final norm (HF's hidden_states[-1] is after it), so final_hidden = the target's final
  RMSNorm (its weight from the checkpoint, its eps from config.json) applied here to slot L. Cost: none in
  the shards (same bytes per token as hf); on the wire (len(ids)+1)*H engine-dtype values per token, the
  same as the shard holds; an RMSNorm per token here.
- Requests: max_tokens 1 (the prefill computes every prompt row), prefix caching off (a cached prefix
  would not be recomputed into the hidden-states cache).
- On vLLM's CPU build the stock ExampleHiddenStatesConnector crashes when a request finishes (CUDA
  streams, pinned memory); eagle3lib.engines.engine_side.vllm_connector subclasses it with a CPU copy and is
  loaded through kv_connector_module_path. On GPUs vLLM's own connector is used.
Plain-prefill tokens/s (for the capture/prefill ratio) come from a plain vllm.LLM of the same flags on the
first sequences, in a subprocess of its own before the capture engine starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3lib.engines.interpreter import ENGINE_SIDE, engine_env, engine_python
from eagle3lib.engines.server import GUARD, alive_in_group, log_tail
from eagle3lib.engines.vllm import check_cores_free
from eagle3lib.extract.shards import plan_batches
from eagle3lib.target.config import target_config_json

SCRIPT = ENGINE_SIDE / "vllm_capture.py"
PREFIX = "@@eagle3lib "


class VLLMExtractError(RuntimeError):
    """The vLLM capture process failed or answered something unexpected; the message carries its log tail."""


def final_norm(pre_norm: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The target's final RMSNorm as Hugging Face's Llama-family models compute it (float32 inside,
    cast back to the input dtype, then the weight): HF hidden_states[-1] from vLLM's id L."""
    dtype = pre_norm.dtype
    h = pre_norm.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(dtype) * h.to(dtype)


class _Worker:
    """vllm_capture.py as a subprocess under engines/guard.py (its own process group, ended with us)."""

    def __init__(self, python, args, env, log_path, timeout_s):
        env = engine_env(env, pythonpath=[ENGINE_SIDE])  # ENGINE_SIDE: vLLM imports our connector by module path
        check_cores_free(env)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "a", buffering=1)
        self.timeout_s = timeout_s
        cmd = [sys.executable, str(GUARD), str(os.getpid()), python, str(SCRIPT), *args]
        self.log.write(f"$ {' '.join(cmd)}\n")
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
            start_new_session=True,
            env=env,
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self.lines.put(json.loads(line[len(PREFIX) :]))
            else:
                self.log.write(line)
        self.lines.put(None)

    def reply(self, what: str) -> dict:
        try:
            msg = self.lines.get(timeout=self.timeout_s)
        except queue.Empty:
            raise VLLMExtractError(
                f"vLLM capture gave no answer to {what} in {self.timeout_s:.0f} s "
                f"(extract.engine_timeout_s). Last lines of {self.log_path}:\n"
                f"{log_tail(self.log_path)}"
            ) from None
        if msg is None or not msg.get("ok", msg.get("ready", False)):
            err = (msg or {}).get("error", f"exited with status {self.proc.poll()}")
            raise VLLMExtractError(
                f"vLLM capture failed during {what}: {err}. Last lines of {self.log_path}:\n{log_tail(self.log_path)}"
            )
        return msg

    def send(self, obj):
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def stop(self, grace_s=60):
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self.proc.stdin.close()  # EOF: the script ends its loop and shuts vLLM down
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        group = self.proc.pid
        if alive_in_group(group):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGTERM)
            deadline = time.time() + 20
            while time.time() < deadline and alive_in_group(group):
                time.sleep(0.2)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        self.proc.wait()
        self.log.close()


class VLLMCapture:
    """The vllm backend for shards.extract_with (a shards.Capture)."""

    name = "vllm"

    def __init__(
        self,
        target_dir,
        aux_layer_ids,
        dtype: str | None = None,
        python=None,
        extra_args=(),
        env=None,
        log_dir=None,
        prefill_benchmark_batches=4,
        batch_tokens=4096,
        timeout_s=1800,
    ):
        self.target_dir, self.aux_layer_ids = str(target_dir), [int(i) for i in aux_layer_ids]
        text, self.architecture = target_config_json(target_dir)
        self.hidden_size, self.vocab_size = int(text["hidden_size"]), int(text["vocab_size"])
        self.num_layers = int(text["num_hidden_layers"])
        self.eps = float(text.get("rms_norm_eps", 1e-6))
        for i in self.aux_layer_ids:
            if not 0 < i < self.num_layers:
                raise ValueError(
                    f"aux layer id {i}: expected 1..{self.num_layers - 1} (HF hidden_states indexing); "
                    f"the final state (id {self.num_layers}) is captured anyway"
                )
        self.layers = self.aux_layer_ids + [self.num_layers]  # vLLM ids = ours; L = pre-norm final
        self.dtype, self.extra_args = dtype, list(extra_args)
        self.python = python or engine_python("vllm") or sys.executable
        self.env = dict(env or {})
        self.log_dir, self.timeout_s = log_dir, timeout_s
        self.prefill_benchmark_batches, self.batch_tokens = prefill_benchmark_batches, batch_tokens
        self._stats, self._worker, self._norm, self._work, self._held = {}, None, None, None, False

    def _common_args(self):
        return ["--target", self.target_dir] + (["--dtype", self.dtype] if self.dtype else [])

    def measure_plain_prefill(self, tok, seq_ids, warmup, log_dir):
        """Tokens/s of a plain vllm.LLM (same flags, no speculation) prefilling these sequences, the first
        `warmup` of them untimed. Returns {plain_prefill_tokens_per_s, tokens, seconds, start_s}."""
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / f".prefill-{os.getpid()}.safetensors"
        _write_sequences(path, tok, seq_ids)
        try:
            args = ["prefill", *self._common_args(), "--tokens", str(path), "--warmup", str(warmup)]
            w = _Worker(
                self.python,
                [*args, "--", *self.extra_args],
                self.env,
                log_dir / "vllm-extract-prefill.log",
                self.timeout_s,
            )
            try:
                return w.reply("the plain-prefill measurement")
            finally:
                w.stop()
        finally:
            path.unlink(missing_ok=True)

    # -- one engine for several extract_with calls (the stage's splits): `with capture: ...` ----------
    def __enter__(self):
        self._held = True
        return self

    def __exit__(self, *exc):
        self._held = False
        self._shutdown()
        return False

    def _launch(self, tok, plan, out_dir):
        """Plain-prefill measurement (optional), then the capture engine; returns the stats of the start."""
        self._work = Path(tempfile.mkdtemp(prefix=".vllm-work-", dir=Path(out_dir).resolve().parent))
        log_dir = Path(self.log_dir or self._work)
        from eagle3lib.target import load_head_tensors

        self._norm = load_head_tensors(self.target_dir)["norm"]
        stats = {}
        if self.prefill_benchmark_batches:
            lengths = (tok["seq_starts"][1:] - tok["seq_starts"][:-1]).tolist()
            batches = plan_batches(lengths, [s for a, b in plan for s in range(a, b)], self.batch_tokens)
            batches = batches[: self.prefill_benchmark_batches + 1]
            if len(batches) >= 2:
                r = self.measure_plain_prefill(tok, [s for b in batches for s in b], len(batches[0]), log_dir)
                stats.update(
                    plain_prefill_tokens_per_s=r["plain_prefill_tokens_per_s"],
                    plain_prefill_tokens=r["tokens"],
                    plain_prefill_engine_start_s=r["start_s"],
                )
        self._worker = _Worker(
            self.python,
            [
                "capture",
                *self._common_args(),
                "--layers",
                ",".join(map(str, self.layers)),
                "--work",
                str(self._work),
                "--",
                *self.extra_args,
            ],
            self.env,
            log_dir / "vllm-extract-capture.log",
            self.timeout_s,
        )
        ready = self._worker.reply("start-up")
        stats.update(
            engine_start_s=ready["start_s"],
            connector=ready["connector"],
            vllm_version=ready["vllm_version"],
            engine_dtype=ready["dtype"],
        )
        return stats

    def _shutdown(self):
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None

    @contextlib.contextmanager
    def session(self, tok, lengths, plan, out_dir):
        t_setup = time.perf_counter()
        self._stats = {"wire_bytes": 0}
        try:
            if self._worker is None:
                self._stats.update(self._launch(tok, plan, out_dir))
            else:
                self._stats["engine_reused"] = True
            self._stats["excluded_s"] = time.perf_counter() - t_setup
            yield self
        except BaseException:
            self._shutdown()
            raise
        if not self._held:
            self._shutdown()

    def shard(self, tok, lengths, first, end, store_dtype, bar):
        work = self._work
        src, out = work / f"in_{first:09d}.safetensors", work / f"out_{first:09d}.safetensors"
        _write_sequences(src, tok, range(first, end))
        self._worker.send({"tokens": str(src), "out": str(out)})
        r = self._worker.reply(f"sequences {first}..{end - 1}")
        hidden = load_file(str(out))["hidden"]  # [N, k+1, H], engine dtype
        src.unlink(missing_ok=True)
        out.unlink(missing_ok=True)
        n, k = hidden.shape[0], len(self.aux_layer_ids)
        if tuple(hidden.shape[1:]) != (k + 1, self.hidden_size):
            raise VLLMExtractError(
                f"vLLM returned rows of shape {tuple(hidden.shape)}, expected [N, {k + 1}, "
                f"{self.hidden_size}] (aux ids {self.aux_layer_ids} and {self.num_layers})"
            )
        self._stats["wire_bytes"] += hidden.numel() * hidden.element_size()
        aux = hidden[:, :k].reshape(n, k * self.hidden_size)
        final = final_norm(hidden[:, k], self._norm, self.eps)
        bar.update(r["tokens"])
        return aux.to(store_dtype), final.to(store_dtype)

    def stats(self):
        return dict(self._stats, final_from=f"vLLM id {self.num_layers} (pre-norm) + the target's final RMSNorm")


def _write_sequences(path, tok, seq_ids):
    """input_ids int32 [N] and seq_starts int64 [S+1] of these sequences, for vllm_capture.py."""
    starts = tok["seq_starts"]
    parts = [tok["input_ids"][int(starts[s]) : int(starts[s + 1])] for s in seq_ids]
    lens = torch.tensor([0] + [p.numel() for p in parts], dtype=torch.int64)
    save_file({"input_ids": torch.cat(parts).to(torch.int32).contiguous(), "seq_starts": lens.cumsum(0)}, str(path))
