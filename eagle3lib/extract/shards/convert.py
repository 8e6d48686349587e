"""A finished extraction rewritten in another store dtype (bf16 shards to fp8: half the disk, no new capture)."""

from __future__ import annotations

import os

from tqdm.auto import tqdm

from eagle3lib.extract.shards.dtypes import FP8, FP8_SCALING, capture_dtype, states, store_states
from eagle3lib.extract.shards.files import write_json
from eagle3lib.extract.shards.format import write_shard
from eagle3lib.extract.shards.manifest import CONTRACT, MANIFEST, load_manifest
from eagle3lib.extract.shards.reader import ShardSet


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
        write_json(os.path.join(out_dir, CONTRACT), src.contract | {"dtype": manifest["store_dtype"]})
    for i in tqdm(range(len(src.shards)), desc="convert", disable=not progress):
        t = src.load(i)
        aux, final = states(t, dtype=capture_dtype(store_dtype))
        tensors = {k: t[k] for k in ("input_ids", "loss_mask", "seq_starts")}
        tensors |= store_states(aux, final, len(m["aux_layer_ids"]), store_dtype)
        manifest["shards"].append(write_shard(out_dir, tensors, t["first_sequence"], m["aux_layer_ids"]))
    manifest["complete"] = True
    write_json(os.path.join(out_dir, MANIFEST), manifest)
    total = sum(e["bytes"] for e in manifest["shards"])
    return {
        "shards": len(manifest["shards"]),
        "tokens": m["num_tokens"],
        "bytes": total,
        "bytes_per_token": total / max(1, m["num_tokens"]),
    }
