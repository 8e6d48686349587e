"""01_extract's sglang_inprocess backend: its shards.Capture over SGLang's model runner (extract/sglang_inprocess.py's
Engine), the command that runs extract_with in SGLang's interpreter, and the notebook's handle that starts it.

Batches are consecutive sequences up to extract.batch_tokens tokens (ragged, no padding), so a shard's rows come
out in token order. The states are cast, or quantized to fp8, on the GPU (shards.store_states) and copied into the
shard's host buffers on a side stream. Its plain prefill is the same extend() on the same first batches with the
capture off.

The command, in SGLang's interpreter (engine.python), started by SGLangInProcess from the notebook's:
    python -m eagle3lib.extract.sglang_inprocess_extract --target DIR --aux-layer-ids 2,15,27 --contract FILE \\
        --split train=PREP/train.safetensors:OUT/train [--split ...] [--store-dtype D] [-- SGLANG FLAGS]
Protocol lines on stdout start with "@@eagle3lib "; everything else is SGLang's log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from eagle3lib.engines.interpreter import module_env, run_module
from eagle3lib.extract import shards
from eagle3lib.extract.sglang_inprocess import Engine, InProcessError
from eagle3lib.target.config import target_config_json

PREFIX = "@@eagle3lib "
LOG = "sglang-inprocess.log"


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

    @classmethod
    def for_target(cls, engine: Engine, target_dir, aux_layer_ids, store_dtype: str, batch_tokens, plain_batches):
        """The capture of `engine` (which runs the target in target_dir), storing in the dtype named store_dtype."""
        from eagle3lib.target import torch_dtype

        text, _ = target_config_json(target_dir)
        store = torch_dtype(store_dtype)
        return cls(engine, text["hidden_size"], text["vocab_size"], aux_layer_ids, store, batch_tokens, plain_batches)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def batches(self, lengths, first: int, end: int) -> list[list[int]]:
        """Sequences [first, end) in consecutive groups of at most batch_tokens tokens, packed without padding:
        concatenated in order, a batch's rows are its tokens in order."""
        return shards.plan_batches(lengths, range(first, end), self.batch_tokens, ragged=True, in_order=True)

    def _seqs(self, tok, batch):
        starts = tok["seq_starts"]
        return [tok["input_ids"][int(starts[s]) : int(starts[s + 1])].tolist() for s in batch]

    def plain_prefill(self, tok, lengths, plan) -> float | None:
        """Tokens/s of the same engine's extend() with the capture off, on the first batches (one untimed)."""
        batches = [batch for a, b in plan for batch in self.batches(lengths, a, b)][: self.plain_batches + 1]
        if len(batches) < 2:
            return None
        self.engine.extend(self._seqs(tok, batches[0]), capture=False)
        _sync()
        t0, n = time.perf_counter(), 0
        for batch in batches[1:]:
            seqs = self._seqs(tok, batch)
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
        for batch in self.batches(lengths, first, end):
            seqs = self._seqs(tok, batch)
            aux, final = self.engine.extend(seqs, capture=True)
            stored = shards.store_states(aux, final, self.n_aux, self.store_dtype)
            if copies is None:
                at += out.put(at, stored)
            else:
                copies.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(copies):
                    at += out.put(at, stored)
                for v in stored.values():  # not reused by the allocator before the copy has read it
                    v.record_stream(copies)
            bar.update(sum(len(q) for q in seqs))
        _sync()  # the host copies are done before the writer thread reads them
        return out.tensors

    def stats(self):
        return dict(self._stats)


# --------------------------------------------------------------------- the notebook's side ----


@dataclass
class SGLangInProcess:
    """01_extract's sglang_inprocess backend as the notebook holds it (backends.Backend): extract_splits runs this
    module in SGLang's interpreter over every split (the model loads once) and returns {split: extract_with's
    result}. A failure raises InProcessError with the log's last lines."""

    target_dir: str
    aux_layer_ids: list[int]
    python: str
    contract: dict
    store_dtype: str
    shard_max_tokens: int
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

    def args(self, splits: dict, contract_file) -> list[str]:
        """The command's arguments (after `python -m` this module) for splits {name: (tokens file, out dir)}."""
        args = ["--target", self.target_dir, "--contract", str(contract_file)]
        args += ["--aux-layer-ids", ",".join(map(str, self.aux_layer_ids)), "--store-dtype", self.store_dtype]
        args += ["--batch-tokens", str(self.batch_tokens), "--shard-max-tokens", str(self.shard_max_tokens)]
        args += ["--plain-batches", str(self.plain_batches)] + (["--dtype", self.dtype] if self.dtype else [])
        for name, (tokens, out) in splits.items():
            args += ["--split", f"{name}={tokens}:{out}"]
        return args + ["--"] + self.extra_args

    def extract_splits(self, splits: dict) -> dict:
        """splits: {name: (tokens file, out dir)} -> {name: result}."""
        log_dir = Path(self.log_dir or next(iter(splits.values()))[1]).resolve()
        log_dir.mkdir(parents=True, exist_ok=True)
        contract_file = log_dir / "sglang-inprocess-contract.json"
        contract_file.write_text(json.dumps(self.contract))
        results = {}

        def take(line: str) -> None:  # the protocol's lines; SGLang's own are in the log only
            at = line.find(PREFIX)  # stderr shares the stream: a line may open with the rest of an unended one
            if at >= 0:
                msg = json.loads(line[at + len(PREFIX) :])
                if "split" in msg:
                    results[msg["split"]] = msg["result"]
                print(f"sglang_inprocess: {msg}", flush=True)

        run_module(
            self.python,
            __name__,
            self.args(splits, contract_file),
            log_dir / LOG,
            env=module_env(self.env),
            on_line=take,
            finished=lambda: set(results) == set(splits),
            failure=lambda code: (
                f"the sglang_inprocess extraction exited {code} with splits {sorted(results)} of {sorted(splits)} "
                f"done (their shards are kept and resume)"
            ),
            error=InProcessError,
        )
        return results

    def plain_prefill_tokens_per_s(self, tokens, result: dict | None, log_dir=None) -> float | None:
        """The plain prefill the extraction timed inside its own run (None when it timed none)."""
        return (result or {}).get("plain_prefill_tokens_per_s") or None


# ------------------------------------------------------------------------ SGLang's side ----


def say(obj) -> None:
    """One protocol line to the notebook's side."""
    sys.stdout.write(PREFIX + json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def parse_args(argv) -> tuple[argparse.Namespace, list[str]]:
    """(the command's options, SGLang's launch flags: what follows `--`)."""
    ap = argparse.ArgumentParser(description="sglang_inprocess extraction (runs in SGLang's interpreter)")
    ap.add_argument("--target", required=True)
    ap.add_argument("--aux-layer-ids", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--contract", required=True, help="the target contract (JSON file) the shards carry")
    ap.add_argument("--split", action="append", required=True, help="NAME=TOKENS_FILE:OUT_DIR")
    ap.add_argument("--store-dtype", default="bfloat16")
    ap.add_argument("--dtype", default=None, help="SGLang's --dtype")
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--shard-max-tokens", type=int, default=None, help="default: about 1 GiB a shard")
    ap.add_argument("--plain-batches", type=int, default=4)
    if "--" in argv:
        i = argv.index("--")
        return ap.parse_args(argv[:i]), argv[i + 1 :]
    return ap.parse_args(argv), []


def main(argv=None) -> int:
    from eagle3lib.prepare.conversations import load_tokens
    from eagle3lib.target import torch_dtype

    a, flags = parse_args(list(sys.argv[1:] if argv is None else argv))
    contract = json.loads(Path(a.contract).read_text())
    aux_ids = a.aux_layer_ids or contract["aux_layer_ids"]
    with Engine(a.target, aux_ids, a.dtype, flags) as engine:
        say({"engine_start_s": round(engine.start_s, 1), "tp": engine.server_args.tp_size})
        for spec in a.split:
            name, rest = spec.split("=", 1)
            tokens_file, out = rest.rsplit(":", 1)
            capture = InProcessCapture.for_target(
                engine, a.target, aux_ids, a.store_dtype, a.batch_tokens, a.plain_batches
            )
            layout = shards.ShardLayout(torch_dtype(a.store_dtype), a.shard_max_tokens, a.batch_tokens)
            r = shards.extract_with(capture, load_tokens(tokens_file), aux_ids, out, contract, layout, progress=False)
            say({"split": name, "result": r})
    return 0


if __name__ == "__main__":
    sys.exit(main())
