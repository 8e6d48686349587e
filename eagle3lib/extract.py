"""Stage 01_extract: capture the target's hidden states and write them as shards.

Input is the prepare stage's flat token arrays: `input_ids` int32 [N], `loss_mask`
uint8 [N], `seq_starts` int64 [S+1] (sequence s is input_ids[seq_starts[s]:seq_starts[s+1]]).
Output, in one folder (DESIGN.md §4):

    eagle3.json                 the target contract, written once, checked on resume
    manifest.json               shards in order: file, sha256, first_sequence, sequences, tokens, bytes
    shard_000000000.safetensors input_ids, loss_mask, aux_hidden [N,3H], final_hidden [N,H], seq_starts

A shard holds whole sequences; its name is its first sequence's index. Shard
boundaries and batches are a pure function of the sequence lengths, shard_max_tokens
and batch_tokens, so a run killed at any point and restarted computes exactly the
batches the uninterrupted run would have and ends with byte-identical shards.
Every file is written to a temp name, fsynced and renamed; a shard counts once the
manifest lists it.
"""
import hashlib
import json
import os
import shutil
import struct
import time

import torch
from safetensors.torch import load as st_load
from tqdm.auto import tqdm

FORMAT = "eagle3lib.hidden_states/1"
MANIFEST = "manifest.json"
CONTRACT = "eagle3.json"
SHARD_KEYS = ("input_ids", "loss_mask", "aux_hidden", "final_hidden", "seq_starts")


class ShardError(RuntimeError):
    """A shard file is missing, corrupt, truncated or inconsistent."""


# ---------------------------------------------------------------------------
# capture


def _base_model(model):
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "norm"):
        raise TypeError(f"expected a Hugging Face causal LM with model.model.layers and model.model.norm "
                        f"(Llama-like), found {type(model).__name__}; load the target with target.py")
    return base


@torch.inference_mode()
def capture_hidden_states(model, input_ids, attention_mask, aux_layer_ids):
    """One forward of the target's base model, keeping only what EAGLE-3 needs.

    Ids use Hugging Face `hidden_states` indexing: id i is the residual stream after
    i decoder layers (0 = embeddings), i.e. the input of decoder layer i; it is taken
    with a pre-hook on layers[i], so no other layer's states are kept. Returns
    aux [B, T, len(ids)*H] (concatenated in id order) and final [B, T, H], the final
    norm's output, so that model.lm_head(final) are the target's logits. The lm_head
    itself is not computed.
    """
    base = _base_model(model)
    n_layers = len(base.layers)
    for i in aux_layer_ids:
        if not 0 <= int(i) < n_layers:
            raise ValueError(f"aux layer id {i} out of range: expected 0 <= id < {n_layers} (the target's "
                             f"decoder layers, HF hidden_states indexing; id {n_layers} is the final norm "
                             f"output, which is stored as final_hidden anyway); fix aux_layer_ids")
    captured = {}

    def keep(k):
        def hook(module, args, kwargs):
            captured[k] = args[0] if args else kwargs["hidden_states"]
        return hook

    handles = [base.layers[int(i)].register_forward_pre_hook(keep(k), with_kwargs=True)
               for k, i in enumerate(aux_layer_ids)]
    device = base.embed_tokens.weight.device
    try:
        out = base(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    final = out.last_hidden_state
    aux = torch.cat([captured[k].to(final.device) for k in range(len(aux_layer_ids))], dim=-1)
    return aux, final


# ---------------------------------------------------------------------------
# inputs, shard plan, batches


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
        raise ValueError(f"tokens: expected seq_starts to run from 0 to len(input_ids)={n}, found "
                         f"{starts[:1].tolist()}..{starts[-1:].tolist()}; rerun the prepare stage")
    lengths = starts[1:] - starts[:-1]
    if (lengths <= 0).any():
        s = int(torch.nonzero(lengths <= 0)[0])
        raise ValueError(f"tokens: sequence {s} has length {int(lengths[s])}; expected every sequence to have "
                         f"at least one token; drop empty sequences in the prepare stage")
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


def make_batch(tok, seq_ids):
    """Right-padded input_ids [B, T] (pad id 0) and attention_mask [B, T] for these sequences."""
    spans = [(int(tok["seq_starts"][s]), int(tok["seq_starts"][s + 1])) for s in seq_ids]
    T = max(b - a for a, b in spans)
    ids = torch.zeros(len(seq_ids), T, dtype=torch.long)
    mask = torch.zeros(len(seq_ids), T, dtype=torch.long)
    for row, (a, b) in enumerate(spans):
        ids[row, :b - a] = tok["input_ids"][a:b]
        mask[row, :b - a] = 1
    return ids, mask


def _range_batches(tok, lengths, first, end, batch_tokens):
    for seq_ids in plan_batches(lengths, range(first, end), batch_tokens):
        yield (seq_ids, *make_batch(tok, seq_ids))


def iter_batches(tokens, batch_tokens, shard_max_tokens):
    """The (seq_ids, input_ids, attention_mask) batches a full extraction runs, in its order."""
    tok = as_token_tensors(tokens)
    lengths = (tok["seq_starts"][1:] - tok["seq_starts"][:-1]).tolist()
    for first, end in plan_shards(lengths, 0, len(lengths), shard_max_tokens):
        yield from _range_batches(tok, lengths, first, end, batch_tokens)


def bytes_per_token(hidden_size, store_dtype, n_aux=3):
    return 4 + 1 + (n_aux + 1) * hidden_size * store_dtype.itemsize


def default_shard_max_tokens(hidden_size, store_dtype, n_aux=3):
    """About 1 GiB per shard."""
    return max(1, 2**30 // bytes_per_token(hidden_size, store_dtype, n_aux))


@torch.inference_mode()
def measure_forward_tokens_per_s(model, batches, warmup=1):
    """Real tokens/s of the target's plain forward (model.model, no hooks, no writes) on these
    (seq_ids, input_ids, attention_mask) batches; the first `warmup` batches are run untimed."""
    base = _base_model(model)
    batches = list(batches)
    device = base.embed_tokens.weight.device
    for _, ids, mask in batches[:warmup]:
        base(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
    timed = batches[warmup:] or batches
    _sync(device)
    t0, tokens = time.perf_counter(), 0
    for _, ids, mask in timed:
        base(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
        tokens += int(mask.sum())
    _sync(device)
    return tokens / (time.perf_counter() - t0)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    the folder. Returns (sha256 hex, bytes written)."""
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.tmp")
    h, n = hashlib.sha256(), 0
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
            h.update(chunk)
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


_ST_DTYPES = {torch.int32: "I32", torch.uint8: "U8", torch.int64: "I64", torch.bfloat16: "BF16",
              torch.float16: "F16", torch.float32: "F32"}


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


def write_shard(out_dir, tensors, first_sequence, aux_layer_ids):
    """Write one shard atomically; return its manifest entry."""
    meta = {"format": FORMAT, "first_sequence": str(first_sequence), "aux_layer_ids": json.dumps(list(aux_layer_ids))}
    name = shard_name(first_sequence)
    sha, size = _atomic_write(os.path.join(out_dir, name), _safetensors_chunks({k: tensors[k] for k in SHARD_KEYS}, meta))
    return {"file": name, "sha256": sha, "first_sequence": first_sequence,
            "sequences": tensors["seq_starts"].numel() - 1, "tokens": tensors["input_ids"].numel(), "bytes": size}


def read_shard(path, expected_sha256=None):
    """Read and check one shard; returns its tensors plus `first_sequence` (int).

    Raises ShardError naming the file and what is wrong when the sha256 differs from the
    manifest's, the file is truncated, or the tensors are inconsistent."""
    def bad(what):
        return ShardError(f"{path}: {what}. Delete this file and rerun extraction on its folder: "
                          f"extract() drops a bad shard from the manifest and redoes just its sequences")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise bad(f"cannot read it ({e})") from None
    if expected_sha256 is not None:
        found = hashlib.sha256(data).hexdigest()
        if found != expected_sha256:
            raise bad(f"sha256 is {found}, the manifest expects {expected_sha256} (corrupt or truncated, "
                      f"{len(data)} bytes)")
    try:
        k = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + k])
        size = 8 + k + max([v["data_offsets"][1] for n, v in header.items() if n != "__metadata__"], default=0)
    except Exception:
        raise bad(f"truncated or not a safetensors file: its {len(data)} bytes do not start with a readable header") from None
    if size != len(data):
        raise bad(f"truncated: {len(data)} bytes, its header describes {size}")
    try:
        meta, t = header.get("__metadata__") or {}, st_load(data)
    except Exception as e:
        raise bad(f"not a readable safetensors file ({type(e).__name__}: {e})") from None
    if meta.get("format") != FORMAT or "first_sequence" not in meta:
        raise bad(f"metadata {meta} is not this format's (expected format={FORMAT!r} and first_sequence)")
    if sorted(t) != sorted(SHARD_KEYS):
        raise bad(f"tensors {sorted(t)}, expected {sorted(SHARD_KEYS)}")
    ids, mask, aux, final, starts = (t[k] for k in SHARD_KEYS)
    n = ids.numel()
    want = {"input_ids": torch.int32, "loss_mask": torch.uint8, "seq_starts": torch.int64}
    for k, dt in want.items():
        if t[k].dtype != dt or t[k].dim() != 1:
            raise bad(f"{k} is {t[k].dtype} with shape {tuple(t[k].shape)}, expected 1-D {dt}")
    if mask.numel() != n:
        raise bad(f"loss_mask has {mask.numel()} entries, input_ids {n}")
    if final.dim() != 2 or final.shape[0] != n or aux.dim() != 2 or aux.shape[0] != n \
            or aux.shape[1] % final.shape[1] or aux.dtype != final.dtype:
        raise bad(f"aux_hidden {tuple(aux.shape)} {aux.dtype} / final_hidden {tuple(final.shape)} {final.dtype} "
                  f"do not fit N={n} tokens (expected [N, k*H] and [N, H] of one dtype)")
    if starts.numel() < 2 or starts[0] != 0 or starts[-1] != n or (starts[1:] <= starts[:-1]).any():
        raise bad(f"seq_starts {starts.tolist()[:8]}... is not increasing from 0 to N={n}")
    t["first_sequence"] = int(meta["first_sequence"])
    return t


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
                    raise ShardError(f"{path}: holds sequences from {t['first_sequence']} ({t['input_ids'].numel()} "
                                     f"tokens), the manifest expects {e['first_sequence']} ({e['tokens']})")
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
# extract


def _check_contract(out_dir, contract):
    path = os.path.join(out_dir, CONTRACT)
    contract = json.loads(json.dumps(contract))
    if not os.path.exists(path):
        _write_json(path, contract)
        return
    with open(path) as f:
        old = json.load(f)
    diff = [f"  {k}: folder has {old.get(k, '<absent>')!r}, this run {contract.get(k, '<absent>')!r}"
            for k in sorted(set(old) | set(contract)) if old.get(k) != contract.get(k)]
    if diff:
        raise ValueError(f"{path} records a different target contract than this run's:\n" + "\n".join(diff) +
                         f"\nThese hidden states belong to another target/setting: use a new out_dir, "
                         f"or delete {out_dir} to extract again")


def _start_manifest(out_dir, tok, aux_layer_ids, hidden_size, store_dtype, shard_max_tokens, batch_tokens):
    want = {"format": FORMAT, "input_sha256": input_sha256(tok), "num_sequences": tok["seq_starts"].numel() - 1,
            "num_tokens": tok["input_ids"].numel(), "hidden_size": hidden_size,
            "aux_layer_ids": [int(i) for i in aux_layer_ids], "store_dtype": str(store_dtype).removeprefix("torch.")}
    manifest = load_manifest(out_dir)
    if manifest is None:
        manifest = dict(want, shard_max_tokens=shard_max_tokens, batch_tokens=batch_tokens, complete=False, shards=[])
        _write_json(os.path.join(out_dir, MANIFEST), manifest)
        return manifest
    diff = [f"  {k}: folder has {manifest.get(k)!r}, this run {v!r}" for k, v in want.items() if manifest.get(k) != v]
    if diff:
        what = "the input sequences differ from the ones" if manifest.get("input_sha256") != want["input_sha256"] \
            else "the settings differ from the ones"
        raise ValueError(f"{out_dir}/{MANIFEST}: {what} this extraction was started with:\n" + "\n".join(diff) +
                         f"\nUse a new out_dir, or delete {out_dir} to extract again from scratch")
    return manifest


def _extract_shard(model, tok, lengths, first, end, aux_layer_ids, batch_tokens, store_dtype, hidden_size, bar):
    starts = tok["seq_starts"]
    base, n = int(starts[first]), int(starts[end] - starts[first])
    aux_buf = torch.empty(n, len(aux_layer_ids) * hidden_size, dtype=store_dtype)
    final_buf = torch.empty(n, hidden_size, dtype=store_dtype)
    for seq_ids, ids, mask in _range_batches(tok, lengths, first, end, batch_tokens):
        aux, final = capture_hidden_states(model, ids, mask, aux_layer_ids)
        aux, final = aux.to(store_dtype).cpu(), final.to(store_dtype).cpu()
        for b, s in enumerate(seq_ids):
            a, m = int(starts[s]) - base, lengths[s]
            aux_buf[a:a + m] = aux[b, :m]
            final_buf[a:a + m] = final[b, :m]
        bar.update(int(mask.sum()))
    return {"input_ids": tok["input_ids"][base:base + n].clone(), "loss_mask": tok["loss_mask"][base:base + n].clone(),
            "aux_hidden": aux_buf, "final_hidden": final_buf, "seq_starts": starts[first:end + 1] - base}


def extract(model, tokens, aux_layer_ids, out_dir, contract, batch_tokens=4096, shard_max_tokens=None,
            store_dtype=torch.bfloat16, progress=True, free_bytes=None, verify_existing=True):
    """Capture aux + final hidden states for every sequence and write them as shards in out_dir.

    Resumes where an earlier call stopped (killed or not): shards the manifest lists and that
    verify are kept, bad or unlisted ones are redone. A complete extraction is not redone.
    shard_max_tokens=None means about 1 GiB per shard. free_bytes overrides the free disk space
    (for tests). verify_existing=False checks existing shards by size instead of sha256.

    Returns {sequences, tokens (done in this call), total_sequences, total_tokens, shards,
    bytes (all shards on disk), bytes_per_token, seconds, tokens_per_s (this call's
    forward+capture+write), complete}.
    """
    tok = as_token_tensors(tokens)
    embed = _base_model(model).embed_tokens
    vocab, hidden_size = embed.weight.shape
    for key, have in (("aux_layer_ids", [int(i) for i in aux_layer_ids]), ("hidden_size", hidden_size)):
        if key in contract and contract[key] != have:
            raise ValueError(f"contract[{key!r}] is {contract[key]!r} but this extraction has {have!r} (from the "
                             f"arguments and the model); build the contract from the same target and aux ids")
    if tok["input_ids"].numel() and (tok["input_ids"].min() < 0 or tok["input_ids"].max() >= vocab):
        raise ValueError(f"tokens: ids range {int(tok['input_ids'].min())}..{int(tok['input_ids'].max())}, expected "
                         f"0..{vocab - 1} (the target's vocab_size); were these tokenized for another model?")
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
        print(f"extract: {sum(b - a for a, b in plan):,} sequences, {todo_tokens:,} tokens to do in {len(plan)} "
              f"shards; needs ~{need / 1e9:.3f} GB ({need:,} bytes), {free:,} bytes free in {out_dir}")
        if free < need:
            raise OSError(f"not enough disk space in {out_dir}: the remaining shards need ~{need:,} bytes, "
                          f"{free:,} bytes are free; free space, pick another out_dir, or extract fewer tokens")

    t0 = time.perf_counter()
    with tqdm(total=todo_tokens, unit="tok", unit_scale=True, disable=not progress, desc="extract") as bar:
        for first, end in plan:
            t = _extract_shard(model, tok, lengths, first, end, aux_layer_ids, batch_tokens, store_dtype, hidden_size,
                               bar)
            manifest["shards"].append(write_shard(out_dir, t, first, aux_layer_ids))
            manifest["shards"].sort(key=lambda e: e["first_sequence"])
            _write_json(os.path.join(out_dir, MANIFEST), manifest)
    seconds = time.perf_counter() - t0
    if not manifest["complete"]:
        manifest["complete"] = True
        _write_json(os.path.join(out_dir, MANIFEST), manifest)
    total_bytes = sum(e["bytes"] for e in manifest["shards"])
    return {"sequences": sum(b - a for a, b in plan), "tokens": todo_tokens,
            "total_sequences": manifest["num_sequences"], "total_tokens": manifest["num_tokens"],
            "shards": len(manifest["shards"]), "bytes": total_bytes,
            "bytes_per_token": total_bytes / max(1, manifest["num_tokens"]), "seconds": seconds,
            "tokens_per_s": todo_tokens / seconds if plan else None, "complete": True}


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
            raise FileNotFoundError(f"{out_dir}: no {MANIFEST}; expected the output folder of extract()")
        path = os.path.join(out_dir, CONTRACT)
        self.contract = None
        if os.path.exists(path):
            with open(path) as f:
                self.contract = json.load(f)
        gaps = _missing_ranges(self.manifest)
        if require_complete and (gaps or not self.manifest["complete"]):
            raise ValueError(f"{out_dir}: extraction is incomplete (sequences {gaps} missing of "
                             f"{self.manifest['num_sequences']}); rerun extract() on this folder to finish it")
        self.shards = sorted(self.manifest["shards"], key=lambda e: e["first_sequence"])

    def __len__(self):
        return sum(e["sequences"] for e in self.shards)

    @property
    def num_tokens(self):
        return sum(e["tokens"] for e in self.shards)

    def load(self, i):
        """Tensors of shard i (verified against the manifest)."""
        e = self.shards[i]
        path = os.path.join(self.out_dir, e["file"])
        t = read_shard(path, e["sha256"] if self.verify else None)
        if t["first_sequence"] != e["first_sequence"] or t["seq_starts"].numel() - 1 != e["sequences"]:
            raise ShardError(f"{path}: holds {t['seq_starts'].numel() - 1} sequences from {t['first_sequence']}, "
                             f"the manifest expects {e['sequences']} from {e['first_sequence']}; delete it and "
                             f"rerun extraction on {self.out_dir}")
        return t

    def __iter__(self):
        """Yield (input_ids, loss_mask, aux_hidden, final_hidden) per sequence, in input order."""
        for i in range(len(self.shards)):
            t = self.load(i)
            st = t["seq_starts"].tolist()
            for a, b in zip(st[:-1], st[1:]):
                yield t["input_ids"][a:b], t["loss_mask"][a:b], t["aux_hidden"][a:b], t["final_hidden"][a:b]

    def verify_all(self) -> int:
        """Read every shard once (sha256 and shape checks); returns the number of sequences."""
        return sum(self.load(i)["seq_starts"].numel() - 1 for i in range(len(self.shards)))
