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

GPU check (one command; prints a JSON of per-layer differences, tokens/s, plain-prefill tokens/s):
    python -m eagle3lib.extract.sglang --compare --n 64 --out /tmp/sglang-check \\
        --extra-args "--attention-backend triton --sampling-backend pytorch --mem-fraction-static 0.5"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import shutil
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from eagle3lib.engines.interpreter import engine_python
from eagle3lib.engines.sglang import SGLANG_CONVENTION, SGLANG_VERSION, preflight, server_flags, sglang_config_ids
from eagle3lib.extract import compare, hf, shards
from eagle3lib.target.config import target_config_json

try:  # the GPU bundle has orjson; a float list decodes ~3x faster with it
    import orjson as _fastjson
except ImportError:  # pragma: no cover - depends on the environment
    _fastjson = None

CAPTURE_DRAFT_ARCH = "LlamaForCausalLMEagle3"
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


# ------------------------------------------------------------------------- target, drafter ----


def target_text_config(target_dir) -> tuple[dict, str]:
    """(text config dict, architecture) from config.json, without importing the model's code."""
    return target_config_json(target_dir)


def write_capture_drafter(target_dir, aux_layer_ids, out_dir, dtype=torch.bfloat16) -> Path:
    """A 1-layer EAGLE-3 drafter of zeros in SGLang's layout (midlayer.*) whose config names the
    aux ids (SGLang's convention for this target). SGLang takes the embeddings from the target."""
    text, arch = target_text_config(target_dir)
    H, V, L = int(text["hidden_size"]), int(text["vocab_size"]), int(text["num_hidden_layers"])
    ids = sglang_config_ids(aux_layer_ids, arch)
    head_dim = next((d for d in (128, 64, 32) if H % d == 0), H)
    heads, inter, dv = H // head_dim, 512, min(256, V)
    rope = text.get("rope_parameters") or {"rope_type": "default", "rope_theta": float(text.get("rope_theta", 10000.0))}
    config = {
        "architectures": [CAPTURE_DRAFT_ARCH],
        "model_type": "llama",
        "hidden_size": H,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "vocab_size": V,
        "draft_vocab_size": dv,
        "target_hidden_size": H,
        "num_hidden_layers": 1,
        "rms_norm_eps": float(text.get("rms_norm_eps", 1e-6)),
        "hidden_act": "silu",
        "max_position_embeddings": int(text.get("max_position_embeddings", 8192)),
        "rope_parameters": rope,
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": ids,
            "use_aux_hidden_state": True,
            "aux_layer_id_convention": SGLANG_CONVENTION,
        },
        "eagle3lib_capture_drafter": {
            "our_aux_layer_ids": [int(i) for i in aux_layer_ids],
            "target_architecture": arch,
            "target_num_layers": L,
            "note": "zeros: only makes SGLang capture these layers",
        },
    }
    shapes = {
        "input_layernorm.weight": [H],
        "hidden_norm.weight": [H],
        "post_attention_layernorm.weight": [H],
        "self_attn.q_proj.weight": [heads * head_dim, 2 * H],
        "self_attn.k_proj.weight": [heads * head_dim, 2 * H],
        "self_attn.v_proj.weight": [heads * head_dim, 2 * H],
        "self_attn.o_proj.weight": [H, heads * head_dim],
        "mlp.gate_proj.weight": [inter, H],
        "mlp.up_proj.weight": [inter, H],
        "mlp.down_proj.weight": [H, inter],
    }
    tensors = {
        f"midlayer.{n}": (torch.ones if n.endswith("norm.weight") else torch.zeros)(s, dtype=dtype)
        for n, s in shapes.items()
    }
    tensors.update(
        {
            "fc.weight": torch.zeros(H, 3 * H, dtype=dtype),
            "norm.weight": torch.ones(H, dtype=dtype),
            "lm_head.weight": torch.zeros(dv, H, dtype=dtype),
            "d2t": torch.zeros(dv, dtype=torch.int64),
            "t2d": torch.arange(V) < dv,
        }
    )
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


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
    chunks = shards._safetensors_chunks(
        {"final_hidden": final.to(torch.float32).contiguous()}, {"first": str(first), "end": str(end)}
    )
    shards._atomic_write(_staged_path(work, first, end), chunks)


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


# ------------------------------------------------------------------------------ GPU check ----


def _check_tokens(a, tokenizer):
    """The check's token arrays: --tokens FILE (data.save_tokens format), else N conversations of --data."""
    from eagle3lib.prepare import conversations, sources

    if a.tokens:
        tokens = conversations.load_tokens(a.tokens)
        n = min(a.n, tokens["seq_starts"].numel() - 1)
        end = int(tokens["seq_starts"][n])
        return {
            "input_ids": tokens["input_ids"][:end],
            "loss_mask": tokens["loss_mask"][:end],
            "seq_starts": tokens["seq_starts"][: n + 1],
            "ids": list(tokens.get("ids", range(n)))[:n],
        }
    convs, _ = sources.load_conversations(a.data, limit=a.n)
    return conversations.tokenize_split(tokenizer, convs, a.max_seq_len, progress=False)


def _save_tokens_main(a):
    """--save-tokens: tokenize N conversations here (no GPU, no sglang) for a GPU host without the data package."""
    from transformers import AutoTokenizer

    from eagle3lib import target
    from eagle3lib.prepare import conversations

    cache = Path(a.cache_dir) if a.cache_dir else target.default_cache_dir()
    tokenizer = AutoTokenizer.from_pretrained(target.resolve_target(a.target, cache))
    a.tokens = None
    path = conversations.save_tokens(a.save_tokens, _check_tokens(a, tokenizer))
    print(json.dumps({"tokens_file": str(path)}))
    return 0


def _compare_main(a):
    """Extract N conversations through sglang and hf on the same tokens; print the differences as JSON."""
    from eagle3lib import target

    cache = Path(a.cache_dir) if a.cache_dir else target.default_cache_dir()
    target_dir = target.resolve_target(a.target, cache)
    model, tokenizer = target.load_target(target_dir, cache, dtype=a.dtype, device=a.device)
    layers = target.num_layers(model.config)
    aux_ids = target.aux_layer_ids(a.aux_layer_ids, layers)
    tokens = _check_tokens(a, tokenizer)
    out = Path(a.out)
    for sub in ("sglang", "hf"):  # a check measures afresh: no resume from an earlier run
        shutil.rmtree(out / sub, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    contract = target.make_contract(a.target, model, tokenizer, aux_ids, a.dtype)
    store = target.torch_dtype(a.dtype)
    report = {
        "target": a.target,
        "dtype": a.dtype,
        "aux_layer_ids": aux_ids,
        "sequences": int(len(tokens["ids"])),
        "tokens": int(tokens["input_ids"].numel()),
    }

    cap = SGLangCapture(
        target_dir,
        aux_ids,
        batch_tokens=a.batch_tokens,
        dtype=a.dtype,
        python=a.engine_python,
        extra_args=shlex.split(a.extra_args),
        log_dir=out,
        concurrency=a.concurrency,
    )
    kw = dict(batch_tokens=a.batch_tokens, shard_max_tokens=a.shard_max_tokens, store_dtype=store, progress=False)
    r_sg = shards.extract_with(cap, tokens, aux_ids, str(out / "sglang"), contract, **kw)
    # The plain forward first: its warm-up also warms the capture (CUDA context, kernels), which a cold
    # capture of a few batches would otherwise pay alone (seen: 0.036 of the forward's rate, cold).
    hf_prefill = hf.measure_forward_tokens_per_s(
        model, list(hf.iter_batches(tokens, a.batch_tokens, a.shard_max_tokens))[:5]
    )
    r_hf = hf.extract(model, tokens, aux_ids, str(out / "hf"), contract, **kw)
    head = model.lm_head.weight.detach()
    report["agreement"] = compare.compare_shard_sets(str(out / "sglang"), str(out / "hf"), lm_head=head)
    report["layer_probe"] = compare.layer_probe(model, str(out / "sglang"), aux_ids, max_sequences=8)
    keep = (
        "tokens_per_s",
        "seconds",
        "engine_start_s",
        "plain_prefill_tokens_per_s",
        "final_pass_tokens_per_s",
        "aux_pass_tokens_per_s",
        "wire_bytes_per_token",
        "bytes_per_token",
        "captured_hf_layers",
    )
    report["sglang"] = {k: r_sg.get(k) for k in keep}
    pp = r_sg.get("plain_prefill_tokens_per_s")
    report["sglang"]["capture_over_plain_prefill"] = (
        r_sg["tokens_per_s"] / pp if pp and r_sg.get("tokens_per_s") else None
    )
    report["hf"] = {
        "tokens_per_s": r_hf["tokens_per_s"],
        "forward_tokens_per_s": hf_prefill,
        "capture_over_forward": r_hf["tokens_per_s"] / hf_prefill if hf_prefill else None,
        "bytes_per_token": r_hf["bytes_per_token"],
    }
    report["ok"] = bool(report["agreement"]["ok"] and report["layer_probe"]["ok"])
    text = json.dumps(report, indent=1, default=str)
    (out / "compare.json").write_text(text + "\n")
    print(text)
    return 0 if report["ok"] else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description="sglang extraction backend; --compare runs the GPU check against hf")
    ap.add_argument("--compare", action="store_true", help="extract through sglang and hf, print the differences")
    ap.add_argument("--n", type=int, default=64, help="conversations")
    ap.add_argument("--out", default="/tmp/eagle3-sglang-check")
    ap.add_argument("--target", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--data", default="embedded:sharegpt")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cuda", help="device of the hf reference")
    ap.add_argument("--aux-layer-ids", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--tokens", default=None, help="token arrays (data.save_tokens file) instead of --data")
    ap.add_argument("--save-tokens", default=None, help="only tokenize --n conversations of --data into this file")
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--shard-max-tokens", type=int, default=32768)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument(
        "--engine-python", default=None, help="interpreter with sglang (default: .venv-sglang, else this one)"
    )
    ap.add_argument("--extra-args", default="", help="more sglang launch flags, one string")
    a = ap.parse_args(argv)
    if a.save_tokens:
        return _save_tokens_main(a)
    if not a.compare:
        ap.error("nothing to do: pass --compare (the stage runs this backend through shards.extract_with)")
    return _compare_main(a)


if __name__ == "__main__":
    sys.exit(main())
