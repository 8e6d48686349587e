"""One shard file: safetensors holding whole sequences, named by its first sequence's index.

    shard_000000000.safetensors input_ids, loss_mask, aux_hidden [N,3H], final_hidden [N,H], seq_starts
                                (store dtype float8_e4m3fn: also aux_scale [N,3], final_scale [N,1], float32)

Written by safetensors_chunks (the same tensors give the same bytes) through files.atomic_write, read back by
read_shard as views of one buffer, every check naming the file and what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct

import torch

from eagle3lib.extract.shards.dtypes import FP8
from eagle3lib.extract.shards.files import atomic_write

FORMAT = "eagle3lib.hidden_states/1"
SHARD_KEYS = ("input_ids", "loss_mask", "aux_hidden", "final_hidden", "seq_starts")
SCALE_KEYS = ("aux_scale", "final_scale")


class ShardError(RuntimeError):
    """A shard file is missing, corrupt, truncated or inconsistent."""


def bytes_per_token(hidden_size, store_dtype, n_aux=3):
    """A token's bytes in a shard: its id, its mask, its states and (fp8) their scales."""
    scales = (n_aux + 1) * 4 if store_dtype == FP8 else 0
    return 4 + 1 + (n_aux + 1) * hidden_size * store_dtype.itemsize + scales


def default_shard_max_tokens(hidden_size, store_dtype, n_aux=3):
    """About 1 GiB per shard."""
    return max(1, 2**30 // bytes_per_token(hidden_size, store_dtype, n_aux))


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


def safetensors_chunks(tensors, metadata):
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


def shard_keys(tensors) -> tuple:
    """The tensors a shard holds: SHARD_KEYS, and SCALE_KEYS when its states are fp8."""
    return SHARD_KEYS + SCALE_KEYS if "aux_scale" in tensors else SHARD_KEYS


def write_shard(out_dir, tensors, first_sequence, aux_layer_ids):
    """Write one shard atomically; return its manifest entry."""
    meta = {"format": FORMAT, "first_sequence": str(first_sequence), "aux_layer_ids": json.dumps(list(aux_layer_ids))}
    name = shard_name(first_sequence)
    sha, size = atomic_write(
        os.path.join(out_dir, name), safetensors_chunks({k: tensors[k] for k in shard_keys(tensors)}, meta)
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
            f"{path}: {what}. Run the extract stage again (python -m eagle3lib run PARAMS --only 01_extract; a "
            f"plain run does when the stage recorded the file's bytes): it drops this shard and extracts its sequences "
            f"again, alone"
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
