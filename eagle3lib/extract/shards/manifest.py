"""An extraction folder's bookkeeping: the target contract (eagle3.json, written once, checked on resume) and the
manifest (manifest.json: the settings, and the shards in order with file, sha256, first_sequence, sequences,
tokens, bytes). A shard counts once the manifest lists it; verify_and_repair drops what does not check out.
"""

from __future__ import annotations

import json
import os

from eagle3lib.extract.shards.dtypes import FP8, FP8_SCALING
from eagle3lib.extract.shards.files import write_json
from eagle3lib.extract.shards.format import FORMAT, ShardError, read_shard
from eagle3lib.extract.shards.plan import ShardLayout
from eagle3lib.extract.shards.tokens import input_sha256

MANIFEST = "manifest.json"
CONTRACT = "eagle3.json"


def load_manifest(out_dir):
    """out_dir's manifest, or None when there is none."""
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def missing_ranges(manifest):
    """Sequence ranges [first, end) that no listed shard covers."""
    ranges, at = [], 0
    for e in sorted(manifest["shards"], key=lambda e: e["first_sequence"]):
        if e["first_sequence"] > at:
            ranges.append((at, e["first_sequence"]))
        at = max(at, e["first_sequence"] + e["sequences"])
    if at < manifest["num_sequences"]:
        ranges.append((at, manifest["num_sequences"]))
    return ranges


def list_shard(out_dir, manifest: dict, entry: dict) -> None:
    """A written shard (write_shard's entry) into the manifest: it counts from now on."""
    manifest["shards"].append(entry)
    manifest["shards"].sort(key=lambda e: e["first_sequence"])
    write_json(os.path.join(out_dir, MANIFEST), manifest)


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
        write_json(os.path.join(out_dir, MANIFEST), manifest)
    return dropped


def check_contract_file(out_dir, contract):
    """Write the target contract into out_dir, or check it against the one already there."""
    path = os.path.join(out_dir, CONTRACT)
    contract = json.loads(json.dumps(contract))
    if not os.path.exists(path):
        write_json(path, contract)
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


def begin_manifest(out_dir, tok, aux_layer_ids, hidden_size, layout: ShardLayout):
    """out_dir's manifest: begun (no shards) when absent, else checked against these tokens and settings."""
    store_dtype = layout.store_dtype
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
        sizes = dict(shard_max_tokens=layout.shard_max_tokens, batch_tokens=layout.batch_tokens)
        manifest = dict(want, **sizes, complete=False, shards=[])
        write_json(os.path.join(out_dir, MANIFEST), manifest)
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
