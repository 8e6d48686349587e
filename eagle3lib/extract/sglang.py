"""The sglang backend of 01_extract: hidden states through an SGLang server (GPU hosts; targets too big for one process).

What SGLang 0.5.17 offers (read in its source; the flags `--enable-return-aux-hidden-states` and
`--return-aux-hidden-state-layer-ids` of later proposals do not exist in this release):
- `--enable-return-hidden-states` lets a request ask for `return_hidden_states: true`; the prefill's
  rows come back in `meta_info["hidden_states"][0]`, one list of floats per prompt token.
- What those rows are depends on the server. Plain: the final normed hidden state [T, H]. With
  `--speculative-algorithm EAGLE3` the target runs its prefill with aux capture on and the rows are
  the concatenated aux states [T, 3H] instead (LogitsProcessor._get_hidden_states_to_store); the final
  state is not returned then, and the pre-norm state after the last layer cannot be asked for (the
  capture happens before a layer runs).
- EAGLE3 needs a draft model, and the aux ids come from the draft's config
  (`eagle_config.eagle_aux_hidden_state_layer_ids`, SGLang's convention). So this backend writes a
  *capture drafter*: a 1-layer EAGLE-3 drafter of zeros whose config names the ids we want, never
  used for anything but making SGLang capture those layers (requests ask for one new token).

So the sglang backend runs two passes over the same tokens, each a plain prefill with max_new_tokens 1:
    pass "final": a plain server with --enable-return-hidden-states -> final_hidden (normed) [T, H]
    pass "aux":   an EAGLE3 server with the capture drafter, --enable-return-hidden-states -> aux [T, 3H]
Pass "final" runs first over every shard still to do and stages its states in out_dir/.sglang-final/
(small: H per token, deleted when the shard is written); then pass "aux" runs shard by shard and the
shards go through the same writer as the hf backend (shards.extract_with). One server runs at a
time, so a target that fills the GPUs fits. The cost of not getting the final state with the aux
states: a second prefill of every token (about 2x the compute) and H more floats per token on the
wire; the shards are the same bytes per token as hf's.

Both servers run with --disable-radix-cache (a cached prefix would not be recomputed, so its rows
would be missing) and --chunked-prefill-size -1 (SGLang drops the hidden states of a prompt's
middle chunks); a response whose row count differs from the prompt's length is refused.

Layer ids (docs/design.md §4): ours are HF hidden_states indices. SGLang 0.5.17 turns config ids j into
captured HF indices in `set_eagle3_layers_to_capture`: Llama-like models j+1 always; DeepSeek-V2/V3
(Kimi-K2.5) and GLM-4-MoE-Lite j+1 only when j[0] == 1, else j as given. engines/sglang.py holds that
rule: sglang_config_ids inverts it per architecture, sglang_captured_ids replays it (tests check one
against the other and against SGLang's own code).

The GPU check against hf (per layer, the layer probe, capture and plain-prefill tokens/s):
benchmarks/extract_check.py sglang, run by benchmarks/h200/extract_sglang_check.sh.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from eagle3lib.engines.interpreter import engine_python
from eagle3lib.engines.sglang import SGLANG_VERSION, preflight, server_flags
from eagle3lib.extract import shards
from eagle3lib.extract.sglang_drafter import write_capture_drafter
from eagle3lib.target.config import target_config_json

try:  # the GPU bundle has orjson; a float list decodes ~3x faster with it
    import orjson as _fastjson
except ImportError:  # pragma: no cover - depends on the environment
    _fastjson = None

STAGING = ".sglang-final"
# Both servers: every prompt token recomputed and returned (see the module docstring), and what SGLang must
# resolve these flags to (checked by check_servers).
COMMON_FLAGS = ["--enable-return-hidden-states", "--disable-radix-cache", "--chunked-prefill-size", "-1"]
HIDDEN_STATES = {
    "return_hidden_states_mode": ("full", "requests ask for return_hidden_states=true"),
    "disable_radix_cache": (True, "a cached prefix would come back without rows"),
    "chunked_prefill_size": (-1, "SGLang drops the hidden states of a prompt's middle chunks"),
}
CAPTURE_DEPTH = 1  # the aux server's EAGLE3 chain: the shortest (no token is ever drafted)


class SGLangExtractError(RuntimeError):
    """SGLang answered something the sglang backend cannot turn into our hidden states."""


# -------------------------------------------------------------------------------- target ----


def target_text_config(target_dir) -> tuple[dict, str]:
    """(text config dict, architecture) from config.json, without importing the model's code."""
    return target_config_json(target_dir)


# ------------------------------------------------------------------------------ commands ----


def _flags(dtype, extra_args) -> list[str]:
    return COMMON_FLAGS + (["--dtype", dtype] if dtype else []) + list(extra_args)


def server_args(target_dir, drafter_dir=None, dtype: str | None = None, extra_args=()) -> list[str]:
    """Launch flags (no --host/--port: engines.Server adds them). drafter_dir None: the plain
    "final" server; else the EAGLE3 "aux" server that captures the drafter config's layers."""
    depth = CAPTURE_DEPTH if drafter_dir is not None else None
    return server_flags(target_dir, drafter_dir, depth, _flags(dtype, extra_args))


def check_servers(target_dir, drafter_dir, aux_layer_ids, dtype, extra_args, python, device=None) -> dict:
    """{final, aux}: both servers' flags through SGLang's own code (engines.sglang.preflight): hidden states
    as HIDDEN_STATES says, and the aux server capturing our ids. Raises EngineError listing the problems."""
    return {
        name: preflight(
            target_dir, drafter, depth, python, _flags(dtype, extra_args), aux_layer_ids, HIDDEN_STATES, device
        )
        for name, drafter, depth in (("final", None, None), ("aux", drafter_dir, CAPTURE_DEPTH))
    }


# ----------------------------------------------------------------------------- requests ----


def generate_body(prompts: list[list[int]], hidden_states: bool) -> dict:
    """/generate request for a batch of prompts (token ids): one new token, greedy."""
    return {
        "input_ids": [list(map(int, p)) for p in prompts],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_hidden_states": bool(hidden_states),
    }


def post_json(url: str, body: dict, timeout: float = 3600) -> tuple[object, int]:
    """POST JSON; returns (decoded answer, bytes received)."""
    data = _fastjson.dumps(body) if _fastjson else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        raise SGLangExtractError(f"{url} answered HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from None
    return (_fastjson.loads(raw) if _fastjson else json.loads(raw)), len(raw)


def decode_hidden_states(item: dict, n_tokens: int, width: int) -> torch.Tensor:
    """The prompt's rows [n_tokens, width] (float32) from one /generate answer with return_hidden_states."""
    meta = item.get("meta_info") or {}
    hs = meta.get("hidden_states")
    if not hs:
        raise SGLangExtractError(
            f"the answer has no meta_info.hidden_states (keys {sorted(meta)}); expected the "
            "server to run with --enable-return-hidden-states and the request to ask for them"
        )
    block = hs[0]
    if block and not isinstance(block[0], list):  # a single row (1-token prompt in some releases)
        block = [block]
    t = torch.tensor(block, dtype=torch.float32)
    if t.dim() != 2 or t.shape[0] != n_tokens or t.shape[1] != width:
        raise SGLangExtractError(
            f"meta_info.hidden_states[0] has shape {tuple(t.shape)}, expected [{n_tokens}, {width}] (one row per "
            f"prompt token). Fewer rows: a cached prefix (keep --disable-radix-cache) or a chunked prefill "
            f"(keep --chunked-prefill-size -1, raise --max-prefill-tokens above the longest sequence); another "
            f"width: the server returned {'aux' if t.dim() == 2 and t.shape[1] > width else 'final'}-style rows"
        )
    return t


class SGLangCapture:
    """The sglang backend for shards.extract_with (a shards.Capture)."""

    name = "sglang"

    def __init__(
        self,
        target_dir,
        aux_layer_ids,
        batch_tokens=16384,
        dtype: str | None = None,
        python=None,
        extra_args=(),
        host="127.0.0.1",
        port=None,
        start_timeout_s=1800,
        env=None,
        log_dir=None,
        concurrency=4,
        prefill_benchmark_batches=4,
        check_args=True,
    ):
        self.target_dir, self.aux_layer_ids = str(target_dir), [int(i) for i in aux_layer_ids]
        text, self.architecture = target_text_config(target_dir)
        self.hidden_size, self.vocab_size = int(text["hidden_size"]), int(text["vocab_size"])
        self.num_layers = int(text["num_hidden_layers"])
        self.batch_tokens, self.dtype, self.extra_args = batch_tokens, dtype, list(extra_args)
        self.python = python or engine_python("sglang") or sys.executable
        self.host, self.port, self.start_timeout_s, self.env = host, port, start_timeout_s, dict(env or {})
        self.log_dir, self.concurrency = log_dir, concurrency
        self.prefill_benchmark_batches, self.check_args = prefill_benchmark_batches, check_args
        self._stats, self._server, self._staging = {}, None, None

    # -- servers ---------------------------------------------------------------------------
    def _server_for(self, drafter_dir, log_dir):
        from eagle3lib.engines.sglang import SGLang

        cmd = [self.python, "-m", "sglang.launch_server"] + server_args(
            self.target_dir, drafter_dir, self.dtype, self.extra_args
        )
        log = Path(log_dir) / f"sglang-extract-{'aux' if drafter_dir else 'final'}.log"
        return SGLang(cmd, log, host=self.host, port=self.port, env=self.env, start_timeout_s=self.start_timeout_s)

    def _start(self, drafter_dir, log_dir):
        server = self._server_for(drafter_dir, log_dir)
        self._server = server
        self._stats["engine_start_s"] = self._stats.get("engine_start_s", 0.0) + server.start()
        return server

    def _stop(self):
        if self._server is not None:
            self._server.stop()
            self._server = None

    def _run_pass(self, server, tok, lengths, seq_ids, width, bar=None):
        """{seq id: rows [len, width]} for these sequences through `server`; also counts wire bytes."""
        starts = tok["seq_starts"]
        batches = shards.plan_batches(lengths, seq_ids, self.batch_tokens)

        def one(batch):
            prompts = [tok["input_ids"][int(starts[s]) : int(starts[s + 1])].tolist() for s in batch]
            answer, nbytes = post_json(server.url + "/generate", generate_body(prompts, True))
            answer = answer if isinstance(answer, list) else [answer]
            if len(answer) != len(batch):
                raise SGLangExtractError(f"sent {len(batch)} prompts, got {len(answer)} answers")
            rows = {s: decode_hidden_states(a, lengths[s], width) for s, a in zip(batch, answer)}
            return rows, nbytes, sum(lengths[s] for s in batch)

        out, wire = {}, 0
        with ThreadPoolExecutor(self.concurrency) as pool:
            for rows, nbytes, n in pool.map(one, batches):
                out.update(rows)
                wire += nbytes
                if bar is not None:
                    bar.update(n)
        self._stats["wire_bytes"] = self._stats.get("wire_bytes", 0) + wire
        return out

    def _plain_prefill(self, server, tok, lengths, seq_ids):
        """Tokens/s of the same server's plain prefill (no hidden states asked) on the first batches."""
        starts = tok["seq_starts"]
        batches = shards.plan_batches(lengths, seq_ids, self.batch_tokens)[: self.prefill_benchmark_batches + 1]
        if len(batches) < 2:
            return None

        def one(batch):
            prompts = [tok["input_ids"][int(starts[s]) : int(starts[s + 1])].tolist() for s in batch]
            post_json(server.url + "/generate", generate_body(prompts, False))
            return sum(lengths[s] for s in batch)

        one(batches[0])  # warm-up
        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.concurrency) as pool:
            n = sum(pool.map(one, batches[1:]))
        return n / (time.perf_counter() - t0)

    def measure_plain_prefill(self, tok, seq_ids, log_dir):
        """Start the plain server, time its prefill of these sequences (first batch untimed), stop it."""
        lengths = (tok["seq_starts"][1:] - tok["seq_starts"][:-1]).tolist()
        server = self._start(None, log_dir)
        try:
            return self._plain_prefill(server, tok, lengths, list(seq_ids))
        finally:
            self._stop()

    # -- extract_with interface --------------------------------------------------------------
    def __enter__(self):  # each call runs its own two passes (the final pass must precede the aux pass)
        return self

    def __exit__(self, *exc):
        return False

    @contextlib.contextmanager
    def session(self, tok, lengths, plan, out_dir):
        t_setup = time.perf_counter()
        self._stats = {}  # this call's figures
        work = Path(out_dir) / STAGING
        work.mkdir(exist_ok=True)
        log_dir = Path(self.log_dir or work)
        drafter = write_capture_drafter(self.target_dir, self.aux_layer_ids, work / "capture-drafter")
        if self.check_args:
            self._stats["captured_hf_layers"] = check_servers(
                self.target_dir, drafter, self.aux_layer_ids, self.dtype, self.extra_args, self.python
            )["aux"]["captured_hf_layers"]
        self._staging, self._aux_t = work, [0.0, 0]
        excluded = time.perf_counter() - t_setup
        try:
            # pass "final": the plain server over every shard still to do, staged on disk
            todo = [(a, b) for a, b in plan if _read_staged(work, a, b, self.hidden_size) is None]
            server = self._start(None, log_dir)
            t0 = time.perf_counter()
            all_seqs = [s for a, b in plan for s in range(a, b)]
            self._stats["plain_prefill_tokens_per_s"] = self._plain_prefill(server, tok, lengths, all_seqs)
            excluded += time.perf_counter() - t0
            t0, n = time.perf_counter(), 0
            for a, b in todo:
                rows = self._run_pass(server, tok, lengths, range(a, b), self.hidden_size)
                final = torch.cat([rows[s] for s in range(a, b)])
                _stage(work, a, b, final)
                n += final.shape[0]
            self._stats["final_pass_tokens_per_s"] = n / (time.perf_counter() - t0) if n else None
            self._stop()
            # pass "aux": the EAGLE3 server; shard() runs it shard by shard
            self._start(drafter, log_dir)
            yield self
        finally:
            self._stop()
        aux_s, aux_n = self._aux_t
        self._stats["aux_pass_tokens_per_s"] = aux_n / aux_s if aux_s else None
        self._stats["excluded_s"] = excluded + self._stats.get("engine_start_s", 0.0)
        shutil.rmtree(work, ignore_errors=True)

    def shard(self, tok, lengths, first, end, store_dtype, bar):
        final = _read_staged(self._staging, first, end, self.hidden_size)
        if final is None:
            raise SGLangExtractError(
                f"the staged final states of sequences {first}..{end - 1} are missing in {self._staging}"
            )
        t0 = time.perf_counter()
        rows = self._run_pass(
            self._server, tok, lengths, range(first, end), len(self.aux_layer_ids) * self.hidden_size, bar
        )
        aux = torch.cat([rows[s] for s in range(first, end)])
        self._aux_t[0] += time.perf_counter() - t0
        self._aux_t[1] += aux.shape[0]
        _drop_staged(self._staging, first, end)
        return aux.to(store_dtype), final.to(store_dtype)

    def stats(self):
        return dict(
            self._stats,
            passes=2,
            sglang_version_expected=SGLANG_VERSION,
            final_from="a second prefill on a plain server with --enable-return-hidden-states (EAGLE3 "
            "returns the aux states in place of the final one)",
        )


# ------------------------------------------------------------------------------ staging ----


def _staged_path(work, first, end):
    return Path(work) / f"final_{first:09d}_{end:09d}.safetensors"


def _stage(work, first, end, final):
    """The final pass's states of one shard, written atomically (in float32: exact for any engine dtype)."""
    chunks = shards.safetensors_chunks(
        {"final_hidden": final.to(torch.float32).contiguous()}, {"first": str(first), "end": str(end)}
    )
    shards.atomic_write(_staged_path(work, first, end), chunks)


def _read_staged(work, first, end, hidden_size):
    path = _staged_path(work, first, end)
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    try:
        t = load_file(str(path))["final_hidden"]
    except Exception:
        path.unlink(missing_ok=True)
        return None
    return t if t.dim() == 2 and t.shape[1] == hidden_size else None


def _drop_staged(work, first, end):
    _staged_path(work, first, end).unlink(missing_ok=True)
