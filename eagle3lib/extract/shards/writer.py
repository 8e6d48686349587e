"""The hidden-state shards of 01_extract: their format, and the one writer every backend goes through.

Input is the prepare stage's flat token arrays: `input_ids` int32 [N], `loss_mask`
uint8 [N], `seq_starts` int64 [S+1] (sequence s is input_ids[seq_starts[s]:seq_starts[s+1]]).
Output, in one folder (docs/design.md §4):

    eagle3.json                 the target contract, written once, checked on resume
    manifest.json               shards in order: file, sha256, first_sequence, sequences, tokens, bytes
    shard_000000000.safetensors input_ids, loss_mask, aux_hidden [N,3H], final_hidden [N,H], seq_starts
                                (store dtype float8_e4m3fn: also aux_scale [N,3], final_scale [N,1], float32)

A shard holds whole sequences; its name is its first sequence's index. Shard
boundaries and batches are a pure function of the sequence lengths, shard_max_tokens
and batch_tokens, so a run killed at any point and restarted computes exactly the
batches the uninterrupted run would have and ends with byte-identical shards.
Every file is written to a temp name, fsynced and renamed; a shard counts once the
manifest lists it.

The states come from a backend behind the Capture protocol (hf.HFCapture, vllm.VLLMCapture,
sglang.SGLangCapture); extract_with writes what any of them captures. compare.py compares two
extractions of the same tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch
from tqdm.auto import tqdm

FORMAT = "eagle3lib.hidden_states/1"
MANIFEST = "manifest.json"
CONTRACT = "eagle3.json"
SHARD_KEYS = ("input_ids", "loss_mask", "aux_hidden", "final_hidden", "seq_starts")
SCALE_KEYS = ("aux_scale", "final_scale")
FP8 = torch.float8_e4m3fn
# A per token and state scale keeps a token's state at e4m3's 3 mantissa bits whatever its magnitude (hidden
# states differ in norm by orders of magnitude across tokens and layers); recorded in the manifest.
FP8_SCALING = "float32 scale per token and state: amax / 448"


class ShardError(RuntimeError):
    """A shard file is missing, corrupt, truncated or inconsistent."""


@runtime_checkable
class Capture(Protocol):
    """A backend of extract_with: hf.HFCapture (the reference), vllm.VLLMCapture, sglang.SGLangCapture.

    name, hidden_size, vocab_size       what the shards and the input check need
    with capture: ...                   an engine that can stays up across the extract_with calls inside
    session(tok, lengths, plan, out_dir)
                                        context manager around all shards of one call (engines start there)
    shard(tok, lengths, first, end, dtype, bar)
                                        -> (aux [n, k*H], final [n, H]) in dtype (capture_dtype(store dtype)),
                                        in token order, or store_states' dict made on the backend's device;
                                        new tensors each call (the writer thread still holds the last ones)
    stats()                             this call's backend figures (engine start, plain prefill, ...); its
                                        `excluded_s` is session time that is not capture (start-up, checks)
    """

    name: str
    hidden_size: int
    vocab_size: int

    def __enter__(self): ...

    def __exit__(self, *exc): ...

    def session(self, tok: dict, lengths: list[int], plan: list, out_dir) -> AbstractContextManager: ...

    def shard(self, tok: dict, lengths: list[int], first: int, end: int, store_dtype, bar) -> tuple: ...

    def stats(self) -> dict: ...


# ---------------------------------------------------------------------------
# inputs and the shard plan


def as_token_tensors(tokens):
    """Check the prepare stage's arrays (numpy or torch) and return them as torch tensors."""
    missing = [k for k in ("input_ids", "loss_mask", "seq_starts") if k not in tokens]
    if missing:
        raise KeyError(f"tokens: expected keys input_ids, loss_mask, seq_starts; missing {missing}")
    ids = torch.as_tensor(tokens["input_ids"]).to(torch.int32).reshape(-1)
    mask = torch.as_tensor(tokens["loss_mask"]).to(torch.uint8).reshape(-1)
    starts = torch.as_tensor(tokens["seq_starts"]).to(torch.int64).reshape(-1)
    n = ids.numel()
    if mask.numel() != n:
        raise ValueError(f"tokens: loss_mask has {mask.numel()} entries, input_ids {n}; expected equal")
    if starts.numel() < 1 or starts[0] != 0 or starts[-1] != n:
        raise ValueError(
            f"tokens: expected seq_starts to run from 0 to len(input_ids)={n}, found "
            f"{starts[:1].tolist()}..{starts[-1:].tolist()}; rerun the prepare stage"
        )
    lengths = starts[1:] - starts[:-1]
    if (lengths <= 0).any():
        s = int(torch.nonzero(lengths <= 0)[0])
        raise ValueError(
            f"tokens: sequence {s} has length {int(lengths[s])}; expected every sequence to have "
            f"at least one token; drop empty sequences in the prepare stage"
        )
    return {"input_ids": ids, "loss_mask": mask, "seq_starts": starts}


def input_sha256(tok):
    h = hashlib.sha256()
    for k, dtype in (("input_ids", torch.int32), ("loss_mask", torch.uint8), ("seq_starts", torch.int64)):
        h.update(tok[k].to(dtype).contiguous().numpy())
    return h.hexdigest()


def plan_shards(lengths, first, end, shard_max_tokens):
    """Split sequences [first, end) into (first, end) ranges, closing a shard at shard_max_tokens."""
    ranges, start, acc = [], first, 0
    for s in range(first, end):
        acc += int(lengths[s])
        if acc >= shard_max_tokens:
            ranges.append((start, s + 1))
            start, acc = s + 1, 0
    if start < end:
        ranges.append((start, end))
    return ranges


def plan_batches(lengths, seq_ids, batch_tokens):
    """Group seq_ids into batches with padded B*T <= batch_tokens, longest first (a longer
    sequence than the budget goes alone). The order is deterministic."""
    order = sorted(seq_ids, key=lambda s: (-int(lengths[s]), s))
    batches = []
    for s in order:
        if batches and (len(batches[-1]) + 1) * int(lengths[batches[-1][0]]) <= batch_tokens:
            batches[-1].append(s)
        else:
            batches.append([s])
    return batches


def bytes_per_token(hidden_size, store_dtype, n_aux=3):
    scales = (n_aux + 1) * 4 if store_dtype == FP8 else 0
    return 4 + 1 + (n_aux + 1) * hidden_size * store_dtype.itemsize + scales


# ---------------------------------------------------------------------------
# fp8 states


def capture_dtype(store_dtype):
    """The dtype a backend hands its states over in: the store dtype, or bf16 for fp8 (quantized by the writer)."""
    return torch.bfloat16 if store_dtype == FP8 else store_dtype


def quantize(x, states, chunk_rows=8192):
    """x [n, states*H] -> (e4m3 [n, states*H], float32 scale [n, states]), each token's state scaled so that its
    largest |value| is e4m3's largest. On x's device, chunk_rows rows at a time (the fp32 copy stays small)."""
    n = x.shape[0]
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(n, states, dtype=torch.float32, device=x.device)
    for a in range(0, n, chunk_rows):
        v = x[a : a + chunk_rows].float().unflatten(-1, (states, -1))
        s = v.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny) / torch.finfo(FP8).max
        q[a : a + chunk_rows] = (v / s[..., None]).to(FP8).flatten(-2)
        scale[a : a + chunk_rows] = s
    return q, scale


def dequantize(q, scale, dtype=torch.bfloat16):
    """The inverse of quantize, for any leading shape: q [..., k*H] e4m3, scale [..., k] -> [..., k*H] dtype."""
    k = scale.shape[-1]
    return (q.unflatten(-1, (k, -1)).to(torch.float32) * scale[..., None]).flatten(-2).to(dtype)


def store_states(aux, final, n_aux, store_dtype) -> dict:
    """A shard's state tensors from a backend's aux [n, k*H] and final [n, H]: cast to the store dtype, or for
    fp8 quantized with their scales. A backend may call this on its own device and hand the dict over."""
    if store_dtype != FP8:
        return {"aux_hidden": aux.to(store_dtype), "final_hidden": final.to(store_dtype)}
    aux_q, aux_scale = quantize(aux, n_aux)
    final_q, final_scale = quantize(final, 1)
    return {"aux_hidden": aux_q, "final_hidden": final_q, "aux_scale": aux_scale, "final_scale": final_scale}


def states(t: dict, a=0, b=None, dtype=torch.bfloat16):
    """(aux, final) rows [a, b) of a shard's tensors in a compute dtype, dequantized where stored as fp8."""
    aux, final = t["aux_hidden"][a:b], t["final_hidden"][a:b]
    if "aux_scale" not in t:
        return aux, final
    return dequantize(aux, t["aux_scale"][a:b], dtype), dequantize(final, t["final_scale"][a:b], dtype)


def default_shard_max_tokens(hidden_size, store_dtype, n_aux=3):
    """About 1 GiB per shard."""
    return max(1, 2**30 // bytes_per_token(hidden_size, store_dtype, n_aux))


# ---------------------------------------------------------------------------
# files: atomic writes, shards, manifest


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path, chunks):
    """Write bytes chunks to a temp name in the same folder, fsync, rename over path, fsync
    the folder. Returns (sha256 hex, bytes written). Each chunk is hashed in a thread while it is written
    (both release the GIL)."""
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.tmp")
    h, n = hashlib.sha256(), 0
    with open(tmp, "wb") as f, ThreadPoolExecutor(1) as hasher:
        for chunk in chunks:
            hashed = hasher.submit(h.update, chunk)
            f.write(chunk)
            hashed.result()
            n += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(folder)
    return h.hexdigest(), n


def _write_json(path, obj):
    _atomic_write(path, [(json.dumps(obj, indent=1) + "\n").encode()])


def shard_name(first_sequence):
    return f"shard_{first_sequence:09d}.safetensors"


# safetensors' dtype names (the shards use six of them)
_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": FP8,
}
_ST_DTYPES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


def _safetensors_chunks(tensors, metadata):
    """The safetensors format, written here so that the same tensors give the same bytes
    (safetensors' own writer orders the metadata at random) and streamed without a copy:
    8-byte little-endian header size, JSON header padded to 8 bytes, the tensors' bytes
    (widest element first, so every tensor is aligned)."""
    tensors = dict(sorted(tensors.items(), key=lambda kv: -kv[1].element_size()))
    header, at = {"__metadata__": metadata}, 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    yield struct.pack("<Q", len(head)) + head
    for t in tensors.values():
        yield t.contiguous().reshape(-1).view(torch.uint8).numpy()  # a buffer, not a copy


def shard_keys(tensors) -> tuple:
    """The tensors a shard holds: SHARD_KEYS, and SCALE_KEYS when its states are fp8."""
    return SHARD_KEYS + SCALE_KEYS if "aux_scale" in tensors else SHARD_KEYS


def write_shard(out_dir, tensors, first_sequence, aux_layer_ids):
    """Write one shard atomically; return its manifest entry."""
    meta = {"format": FORMAT, "first_sequence": str(first_sequence), "aux_layer_ids": json.dumps(list(aux_layer_ids))}
    name = shard_name(first_sequence)
    sha, size = _atomic_write(
        os.path.join(out_dir, name), _safetensors_chunks({k: tensors[k] for k in shard_keys(tensors)}, meta)
    )
    return {
        "file": name,
        "sha256": sha,
        "first_sequence": first_sequence,
        "sequences": tensors["seq_starts"].numel() - 1,
        "tokens": tensors["input_ids"].numel(),
        "bytes": size,
    }


def read_shard(path, expected_sha256=None):
    """Read and check one shard; returns its tensors plus `first_sequence` (int).

    Raises ShardError naming the file and what is wrong when the sha256 differs from the
    manifest's, the file is truncated, or the tensors are inconsistent."""

    def bad(what):
        return ShardError(
            f"{path}: {what}. Delete this file and rerun extraction on its folder: "
            f"extract() drops a bad shard from the manifest and redoes just its sequences"
        )

    try:
        with open(path, "rb") as f:
            data = bytearray(os.fstat(f.fileno()).st_size)  # tensors below are views of it: no second copy
            got = f.readinto(data)
    except OSError as e:
        raise bad(f"cannot read it ({e})") from None
    if got != len(data):
        raise bad(f"read {got} of its {len(data)} bytes (changed while read?)")
    if expected_sha256 is not None:
        found = hashlib.sha256(data).hexdigest()
        if found != expected_sha256:
            raise bad(
                f"sha256 is {found}, the manifest expects {expected_sha256} (corrupt or truncated, {len(data)} bytes)"
            )
    try:
        k = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8 : 8 + k])
        size = 8 + k + max([v["data_offsets"][1] for n, v in header.items() if n != "__metadata__"], default=0)
    except Exception:
        raise bad(
            f"truncated or not a safetensors file: its {len(data)} bytes do not start with a readable header"
        ) from None
    if size != len(data):
        raise bad(f"truncated: {len(data)} bytes, its header describes {size}")
    try:
        meta, t = header.get("__metadata__") or {}, _tensor_views(data, 8 + k, header)
    except Exception as e:
        raise bad(f"not a readable safetensors file ({type(e).__name__}: {e})") from None
    if meta.get("format") != FORMAT or "first_sequence" not in meta:
        raise bad(f"metadata {meta} is not this format's (expected format={FORMAT!r} and first_sequence)")
    if sorted(t) != sorted(shard_keys(t)):
        raise bad(f"tensors {sorted(t)}, expected {sorted(shard_keys(t))}")
    ids, mask, aux, final, starts = (t[k] for k in SHARD_KEYS)
    n = ids.numel()
    want = {"input_ids": torch.int32, "loss_mask": torch.uint8, "seq_starts": torch.int64}
    for k, dt in want.items():
        if t[k].dtype != dt or t[k].dim() != 1:
            raise bad(f"{k} is {t[k].dtype} with shape {tuple(t[k].shape)}, expected 1-D {dt}")
    if mask.numel() != n:
        raise bad(f"loss_mask has {mask.numel()} entries, input_ids {n}")
    if (
        final.dim() != 2
        or final.shape[0] != n
        or aux.dim() != 2
        or aux.shape[0] != n
        or aux.shape[1] % final.shape[1]
        or aux.dtype != final.dtype
    ):
        raise bad(
            f"aux_hidden {tuple(aux.shape)} {aux.dtype} / final_hidden {tuple(final.shape)} {final.dtype} "
            f"do not fit N={n} tokens (expected [N, k*H] and [N, H] of one dtype)"
        )
    if (aux.dtype == FP8) != ("aux_scale" in t):
        raise bad(f"states are {aux.dtype} with tensors {sorted(t)}: fp8 states need their scales, others none")
    if "aux_scale" in t:
        k = aux.shape[1] // final.shape[1]
        for name, cols in (("aux_scale", k), ("final_scale", 1)):
            if t[name].dtype != torch.float32 or tuple(t[name].shape) != (n, cols):
                raise bad(f"{name} is {t[name].dtype} {tuple(t[name].shape)}, expected float32 ({n}, {cols})")
    if starts.numel() < 2 or starts[0] != 0 or starts[-1] != n or (starts[1:] <= starts[:-1]).any():
        raise bad(f"seq_starts {starts.tolist()[:8]}... is not increasing from 0 to N={n}")
    t["first_sequence"] = int(meta["first_sequence"])
    return t


def _tensor_views(data: bytearray, base: int, header: dict) -> dict:
    """The tensors of a safetensors file held in `data`, as views of it (safetensors' load(bytes) copies each
    tensor again; a shard is up to GBs and the trainer reads one every few steps)."""
    out = {}
    for name, v in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (start, end) = _SAFETENSORS_DTYPES[v["dtype"]], v["shape"], v["data_offsets"]
        count = math.prod(shape)
        if end - start != count * dtype.itemsize or start < 0 or base + end > len(data):
            raise ValueError(f"{name}: bytes {start}..{end} do not hold {v['dtype']} {shape}")
        out[name] = (
            torch.frombuffer(data, dtype=dtype, count=count, offset=base + start).view(shape)
            if count
            else torch.empty(shape, dtype=dtype)
        )
    return out


def load_manifest(out_dir):
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _missing_ranges(manifest):
    """Sequence ranges [first, end) that no listed shard covers."""
    ranges, at = [], 0
    for e in sorted(manifest["shards"], key=lambda e: e["first_sequence"]):
        if e["first_sequence"] > at:
            ranges.append((at, e["first_sequence"]))
        at = max(at, e["first_sequence"] + e["sequences"])
    if at < manifest["num_sequences"]:
        ranges.append((at, manifest["num_sequences"]))
    return ranges


def verify_and_repair(out_dir, check_sha256=True):
    """Check every shard the manifest lists; drop the bad ones from the manifest and delete
    them, delete temp files and shard files the manifest does not list (incomplete work).
    The next extract() redoes exactly the dropped sequences. Returns [(file, reason)] dropped."""
    manifest = load_manifest(out_dir)
    dropped, keep = [], []
    for e in (manifest or {}).get("shards", []):
        path = os.path.join(out_dir, e["file"])
        try:
            if not os.path.exists(path):
                raise ShardError(f"{path}: missing")
            if check_sha256:
                t = read_shard(path, e["sha256"])
                if t["first_sequence"] != e["first_sequence"] or t["input_ids"].numel() != e["tokens"]:
                    raise ShardError(
                        f"{path}: holds sequences from {t['first_sequence']} ({t['input_ids'].numel()} "
                        f"tokens), the manifest expects {e['first_sequence']} ({e['tokens']})"
                    )
            elif os.path.getsize(path) != e["bytes"]:
                raise ShardError(f"{path}: {os.path.getsize(path)} bytes, the manifest expects {e['bytes']}")
            keep.append(e)
        except ShardError as err:
            dropped.append((e["file"], str(err)))
    listed = {e["file"] for e in keep}
    for name in os.listdir(out_dir):
        stray_tmp = name.startswith(".") and name.endswith(".tmp")
        stray_shard = name.startswith("shard_") and name.endswith(".safetensors") and name not in listed
        if stray_tmp or stray_shard:
            os.remove(os.path.join(out_dir, name))
    if dropped:
        manifest["shards"] = keep
        manifest["complete"] = False
        _write_json(os.path.join(out_dir, MANIFEST), manifest)
    return dropped


# ---------------------------------------------------------------------------
# the writer


def _check_contract(out_dir, contract):
    path = os.path.join(out_dir, CONTRACT)
    contract = json.loads(json.dumps(contract))
    if not os.path.exists(path):
        _write_json(path, contract)
        return
    with open(path) as f:
        old = json.load(f)
    diff = [
        f"  {k}: folder has {old.get(k, '<absent>')!r}, this run {contract.get(k, '<absent>')!r}"
        for k in sorted(set(old) | set(contract))
        if old.get(k) != contract.get(k)
    ]
    if diff:
        raise ValueError(
            f"{path} records a different target contract than this run's:\n"
            + "\n".join(diff)
            + f"\nThese hidden states belong to another target/setting: use a new out_dir, "
            f"or delete {out_dir} to extract again"
        )


def _start_manifest(out_dir, tok, aux_layer_ids, hidden_size, store_dtype, shard_max_tokens, batch_tokens):
    want = {
        "format": FORMAT,
        "input_sha256": input_sha256(tok),
        "num_sequences": tok["seq_starts"].numel() - 1,
        "num_tokens": tok["input_ids"].numel(),
        "hidden_size": hidden_size,
        "aux_layer_ids": [int(i) for i in aux_layer_ids],
        "store_dtype": str(store_dtype).removeprefix("torch."),
    }
    if store_dtype == FP8:  # absent from other manifests, so that bf16 folders of older runs still resume
        want["state_scaling"] = FP8_SCALING
    manifest = load_manifest(out_dir)
    if manifest is None:
        manifest = dict(want, shard_max_tokens=shard_max_tokens, batch_tokens=batch_tokens, complete=False, shards=[])
        _write_json(os.path.join(out_dir, MANIFEST), manifest)
        return manifest
    diff = [f"  {k}: folder has {manifest.get(k)!r}, this run {v!r}" for k, v in want.items() if manifest.get(k) != v]
    if diff:
        what = (
            "the input sequences differ from the ones"
            if manifest.get("input_sha256") != want["input_sha256"]
            else "the settings differ from the ones"
        )
        raise ValueError(
            f"{out_dir}/{MANIFEST}: {what} this extraction was started with:\n"
            + "\n".join(diff)
            + f"\nUse a new out_dir, or delete {out_dir} to extract again from scratch"
        )
    return manifest


def open_extraction(out_dir, tok, aux_layer_ids, hidden_size, store_dtype, shard_max_tokens, batch_tokens, contract):
    """out_dir's manifest for these tokens and settings, begun when absent, its bad or unlisted shards dropped:
    what extract_with starts from, for a writer whose states come from elsewhere (online training's first-epoch
    cache, which list_shard's its shards as they are written)."""
    os.makedirs(out_dir, exist_ok=True)
    _check_contract(out_dir, contract)
    _start_manifest(out_dir, tok, aux_layer_ids, hidden_size, store_dtype, shard_max_tokens, batch_tokens)
    for name, why in verify_and_repair(out_dir, check_sha256=False):
        print(f"dropped {name}, its sequences will be redone: {why}")
    return load_manifest(out_dir)


def list_shard(out_dir, manifest: dict, entry: dict) -> None:
    """A written shard (write_shard's entry) into the manifest: it counts from now on."""
    manifest["shards"].append(entry)
    manifest["shards"].sort(key=lambda e: e["first_sequence"])
    _write_json(os.path.join(out_dir, MANIFEST), manifest)


def shard_tensors(tok, first, end, stored: dict):
    """The tensors of the shard holding sequences [first, end), given their states in token order (store_states)."""
    starts = tok["seq_starts"]
    base, n = int(starts[first]), int(starts[end] - starts[first])
    rows = {k: v.shape[0] for k, v in stored.items()}
    if any(r != n for r in rows.values()):
        raise ValueError(
            f"sequences {first}..{end - 1} have {n} tokens, the backend returned rows {rows}; expected one row per token"
        )
    return {
        "input_ids": tok["input_ids"][base : base + n].clone(),
        "loss_mask": tok["loss_mask"][base : base + n].clone(),
        **{k: v.cpu() for k, v in stored.items()},
        "seq_starts": starts[first : end + 1] - base,
    }


def extract_with(
    capture: Capture,
    tokens,
    aux_layer_ids,
    out_dir,
    contract,
    batch_tokens=4096,
    shard_max_tokens=None,
    store_dtype=torch.bfloat16,
    progress=True,
    free_bytes=None,
    verify_existing=True,
    writers=2,
):
    """Capture aux + final hidden states for every sequence through `capture` (a backend, see Capture)
    and write them as shards.

    Resumes where an earlier call stopped (killed or not): shards the manifest lists and that
    verify are kept, bad or unlisted ones are redone. A complete extraction is not redone.
    shard_max_tokens=None means about 1 GiB per shard. free_bytes overrides the free disk space
    (for tests). verify_existing=False checks existing shards by size instead of sha256.
    batch_tokens is recorded in the manifest (and used by the hf backend). writers: shards written (bytes,
    sha256, fsync) at once in threads while the next one is captured.

    Returns {backend, sequences, tokens (done in this call), total_sequences, total_tokens, shards,
    bytes (all shards on disk), bytes_per_token, seconds, tokens_per_s (this call's capture+write,
    engine start-up excluded), complete, capture_s, write_wait_s (capture waiting for the writer)} plus the
    backend's stats() (engine start, plain prefill...).
    """
    tok = as_token_tensors(tokens)
    vocab, hidden_size = int(capture.vocab_size), int(capture.hidden_size)
    for key, have in (("aux_layer_ids", [int(i) for i in aux_layer_ids]), ("hidden_size", hidden_size)):
        if key in contract and contract[key] != have:
            raise ValueError(
                f"contract[{key!r}] is {contract[key]!r} but this extraction has {have!r} (from the "
                f"arguments and the model); build the contract from the same target and aux ids"
            )
    if tok["input_ids"].numel() and (tok["input_ids"].min() < 0 or tok["input_ids"].max() >= vocab):
        raise ValueError(
            f"tokens: ids range {int(tok['input_ids'].min())}..{int(tok['input_ids'].max())}, expected "
            f"0..{vocab - 1} (the target's vocab_size); were these tokenized for another model?"
        )
    shard_max_tokens = shard_max_tokens or default_shard_max_tokens(hidden_size, store_dtype, len(aux_layer_ids))
    os.makedirs(out_dir, exist_ok=True)
    _check_contract(out_dir, contract)
    _start_manifest(out_dir, tok, aux_layer_ids, hidden_size, store_dtype, shard_max_tokens, batch_tokens)
    for name, why in verify_and_repair(out_dir, check_sha256=verify_existing):
        print(f"extract: dropped {name}, will redo its sequences: {why}")
    manifest = load_manifest(out_dir)

    starts = tok["seq_starts"]
    lengths = (starts[1:] - starts[:-1]).tolist()
    plan = [r for a, b in _missing_ranges(manifest) for r in plan_shards(lengths, a, b, shard_max_tokens)]
    todo_tokens = sum(int(starts[b] - starts[a]) for a, b in plan)
    if plan:
        need = todo_tokens * bytes_per_token(hidden_size, store_dtype, len(aux_layer_ids)) + 4096 * len(plan) + 2**16
        free = shutil.disk_usage(out_dir).free if free_bytes is None else free_bytes
        print(
            f"extract ({capture.name}): {sum(b - a for a, b in plan):,} sequences, {todo_tokens:,} tokens to do in "
            f"{len(plan)} shards; needs ~{need / 1e9:.3f} GB ({need:,} bytes), {free:,} bytes free in {out_dir}"
        )
        if free < need:
            raise OSError(
                f"not enough disk space in {out_dir}: the remaining shards need ~{need:,} bytes, "
                f"{free:,} bytes are free; free space, pick another out_dir, or extract fewer tokens"
            )

    seconds, stats = 0.0, {}
    if plan:
        t0 = time.perf_counter()
        waits = {"capture_s": 0.0, "write_wait_s": 0.0}

        def listed(pending):  # a shard enters the manifest only once its file is complete on disk
            t = time.perf_counter()
            entry = pending.result()
            waits["write_wait_s"] += time.perf_counter() - t
            list_shard(out_dir, manifest, entry)

        # Shards are written (bytes, sha256, fsync: ~3 s a GB) in threads while the next one is captured;
        # on an H200 the synchronous write held the hf backend to 0.11 of the target's forward.
        with (
            tqdm(total=todo_tokens, unit="tok", unit_scale=True, disable=not progress, desc="extract") as bar,
            capture.session(tok, lengths, plan, out_dir),
            ThreadPoolExecutor(max(1, writers)) as writer,
        ):
            pending = deque()
            for first, end in plan:
                t = time.perf_counter()
                got = capture.shard(tok, lengths, first, end, capture_dtype(store_dtype), bar)
                stored = got if isinstance(got, dict) else store_states(*got, len(aux_layer_ids), store_dtype)
                tensors = shard_tensors(tok, first, end, stored)
                waits["capture_s"] += time.perf_counter() - t
                while len(pending) >= max(1, writers):
                    listed(pending.popleft())
                # backends return new tensors per shard, so the next capture cannot overwrite these
                pending.append(writer.submit(write_shard, out_dir, tensors, first, aux_layer_ids))
            while pending:
                listed(pending.popleft())
        stats = {**capture.stats(), **{k: round(v, 2) for k, v in waits.items()}}
        # Engine start-up (loading the target, spawning workers) is reported apart, not as capture time.
        seconds = time.perf_counter() - t0 - stats.get("excluded_s", 0.0)
        if stats.get("wire_bytes"):  # what an engine sent back per token (its cost of the final state shows here)
            stats["wire_bytes_per_token"] = stats["wire_bytes"] / max(1, todo_tokens)
    if not manifest["complete"]:
        manifest["complete"] = True
        _write_json(os.path.join(out_dir, MANIFEST), manifest)
    total_bytes = sum(e["bytes"] for e in manifest["shards"])
    return {
        "backend": capture.name,
        "sequences": sum(b - a for a, b in plan),
        "tokens": todo_tokens,
        "total_sequences": manifest["num_sequences"],
        "total_tokens": manifest["num_tokens"],
        "shards": len(manifest["shards"]),
        "bytes": total_bytes,
        "bytes_per_token": total_bytes / max(1, manifest["num_tokens"]),
        "seconds": seconds,
        "tokens_per_s": todo_tokens / seconds if plan and seconds > 0 else None,
        "complete": True,
        **stats,
    }


def convert_store_dtype(src_dir, out_dir, store_dtype, progress=True) -> dict:
    """A finished extraction rewritten in another store dtype (bf16 shards to fp8: half the disk, no new
    capture; the states go through the same store_states as a capture's). src_dir is only read. Returns
    {shards, tokens, bytes, bytes_per_token} of out_dir."""
    src = ShardSet(src_dir)
    os.makedirs(out_dir, exist_ok=True)
    if load_manifest(out_dir) is not None:
        raise ValueError(f"{out_dir} already holds an extraction; pick an empty folder")
    m = src.manifest
    manifest = {k: v for k, v in m.items() if k not in ("shards", "state_scaling", "store_dtype", "complete")}
    manifest |= {"store_dtype": str(store_dtype).removeprefix("torch."), "complete": False, "shards": []}
    if store_dtype == FP8:
        manifest["state_scaling"] = FP8_SCALING
    if src.contract is not None:  # its dtype is the store dtype (target.make_contract in 01_extract)
        _write_json(os.path.join(out_dir, CONTRACT), src.contract | {"dtype": manifest["store_dtype"]})
    for i in tqdm(range(len(src.shards)), desc="convert", disable=not progress):
        t = src.load(i)
        aux, final = states(t, dtype=capture_dtype(store_dtype))
        tensors = {k: t[k] for k in ("input_ids", "loss_mask", "seq_starts")}
        tensors |= store_states(aux, final, len(m["aux_layer_ids"]), store_dtype)
        manifest["shards"].append(write_shard(out_dir, tensors, t["first_sequence"], m["aux_layer_ids"]))
    manifest["complete"] = True
    _write_json(os.path.join(out_dir, MANIFEST), manifest)
    total = sum(e["bytes"] for e in manifest["shards"])
    return {
        "shards": len(manifest["shards"]),
        "tokens": m["num_tokens"],
        "bytes": total,
        "bytes_per_token": total / max(1, m["num_tokens"]),
    }


# ---------------------------------------------------------------------------
# reading


class ShardSet:
    """A finished extraction: the manifest, the contract, and its sequences in order.

    shards = ShardSet("outputs/run/01_extract/hidden")
    for input_ids, loss_mask, aux, final in shards: ...
    """

    def __init__(self, out_dir, verify=True, require_complete=True):
        self.out_dir = out_dir
        self.verify = verify
        self.manifest = load_manifest(out_dir)
        if self.manifest is None:
            raise FileNotFoundError(f"{out_dir}: no {MANIFEST}; expected the output folder of extract_with()")
        path = os.path.join(out_dir, CONTRACT)
        self.contract = None
        if os.path.exists(path):
            with open(path) as f:
                self.contract = json.load(f)
        gaps = _missing_ranges(self.manifest)
        if require_complete and (gaps or not self.manifest["complete"]):
            raise ValueError(
                f"{out_dir}: extraction is incomplete (sequences {gaps} missing of "
                f"{self.manifest['num_sequences']}); rerun extract() on this folder to finish it"
            )
        self.shards = sorted(self.manifest["shards"], key=lambda e: e["first_sequence"])
        self._verified = {}  # file -> (size, mtime_ns, inode) when its sha256 last matched

    def __len__(self):
        return sum(e["sequences"] for e in self.shards)

    @property
    def num_tokens(self):
        return sum(e["tokens"] for e in self.shards)

    def load(self, i):
        """Tensors of shard i, verified against the manifest: its sha256 the first time this ShardSet reads it,
        and again whenever its size, mtime or inode has changed since. Training reads every shard once an epoch,
        and hashing was most of the read (sha256 ~0.5 GB/s with the read, 1.3 GB/s without, on this CPU)."""
        e = self.shards[i]
        path = os.path.join(self.out_dir, e["file"])
        try:
            st = os.stat(path)
            stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
        except OSError:
            stamp = None  # read_shard says what is wrong
        checked = stamp is not None and self._verified.get(e["file"]) == stamp
        t = read_shard(path, e["sha256"] if self.verify and not checked else None)
        if self.verify and stamp is not None:
            self._verified[e["file"]] = stamp
        if t["first_sequence"] != e["first_sequence"] or t["seq_starts"].numel() - 1 != e["sequences"]:
            raise ShardError(
                f"{path}: holds {t['seq_starts'].numel() - 1} sequences from {t['first_sequence']}, "
                f"the manifest expects {e['sequences']} from {e['first_sequence']}; delete it and "
                f"rerun extraction on {self.out_dir}"
            )
        return t

    def __iter__(self):
        """Yield (input_ids, loss_mask, aux_hidden, final_hidden) per sequence, in input order; fp8 states
        dequantized to bf16."""
        for i in range(len(self.shards)):
            t = self.load(i)
            st = t["seq_starts"].tolist()
            for a, b in zip(st[:-1], st[1:]):
                yield t["input_ids"][a:b], t["loss_mask"][a:b], *states(t, a, b)

    def verify_all(self) -> int:
        """Read every shard once (sha256 and shape checks); returns the number of sequences."""
        return sum(self.load(i)["seq_starts"].numel() - 1 for i in range(len(self.shards)))
