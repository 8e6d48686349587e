"""A finished extraction read back: ShardSet, its sequences in input order, each shard checked against the
manifest (its sha256 the first time, and again when the file changed)."""

from __future__ import annotations

import json
import os

from eagle3lib.extract.shards.dtypes import states
from eagle3lib.extract.shards.format import ShardError, read_shard
from eagle3lib.extract.shards.manifest import CONTRACT, MANIFEST, load_manifest, missing_ranges


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
        gaps = missing_ranges(self.manifest)
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
        and again whenever its size, mtime or inode has changed since (training reads every shard once an epoch,
        and hashing is most of a read)."""
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
                f"the manifest expects {e['sequences']} from {e['first_sequence']}; run the extract stage again "
                f"(python -m eagle3lib run PARAMS --only 01_extract), which drops it and extracts its sequences alone"
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
