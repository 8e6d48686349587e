"""The hidden-state shards of 01_extract: their format, the one writer every backend goes through, the reader.

Input is the prepare stage's flat token arrays; output, in one folder (docs/design.md §4):

    eagle3.json                 the target contract, written once, checked on resume
    manifest.json               shards in order: file, sha256, first_sequence, sequences, tokens, bytes
    shard_000000000.safetensors input_ids, loss_mask, aux_hidden [N,3H], final_hidden [N,H], seq_starts
                                (store dtype float8_e4m3fn: also aux_scale [N,3], final_scale [N,1], float32)

    tokens.py    the token arrays checked (as_token_tensors) and hashed
    plan.py      the layout (ShardLayout), shard boundaries and batches: a pure function of the lengths and budgets
    dtypes.py    the store dtype: a cast, or fp8 with a float32 scale per token and state
    files.py     atomic writes (temp name, fsync, rename)
    format.py    one shard file: safetensors bytes written deterministically, read back and checked
    manifest.py  the folder's contract and manifest, resume's repair, the sequences no shard holds yet
    writer.py    ShardWriter, the one writer of a folder's shards; the Capture protocol and extract_with
    reader.py    ShardSet, a finished extraction read back
    convert.py   a finished extraction rewritten in another store dtype

The names below are the package's public API (`from eagle3lib.extract import shards; shards.ShardSet(...)`).
compare.py (beside this package) compares two extractions of the same tokens.
"""

from eagle3lib.extract.shards.convert import convert_store_dtype
from eagle3lib.extract.shards.dtypes import FP8, FP8_SCALING, capture_dtype, dequantize, quantize, states, store_states
from eagle3lib.extract.shards.files import atomic_write
from eagle3lib.extract.shards.format import (
    FORMAT,
    SCALE_KEYS,
    SHARD_KEYS,
    ShardError,
    bytes_per_token,
    default_shard_max_tokens,
    read_shard,
    safetensors_chunks,
    shard_keys,
    shard_name,
    write_shard,
)
from eagle3lib.extract.shards.manifest import CONTRACT, MANIFEST, load_manifest, verify_and_repair
from eagle3lib.extract.shards.plan import ShardLayout, plan_batches, plan_shards
from eagle3lib.extract.shards.reader import ShardSet
from eagle3lib.extract.shards.tokens import as_token_tensors, input_sha256
from eagle3lib.extract.shards.writer import Capture, CaptureHere, ShardWriter, extract_with

__all__ = [
    "CONTRACT",
    "FORMAT",
    "FP8",
    "FP8_SCALING",
    "MANIFEST",
    "SCALE_KEYS",
    "SHARD_KEYS",
    "Capture",
    "CaptureHere",
    "ShardError",
    "ShardLayout",
    "ShardSet",
    "ShardWriter",
    "as_token_tensors",
    "atomic_write",
    "bytes_per_token",
    "capture_dtype",
    "convert_store_dtype",
    "default_shard_max_tokens",
    "dequantize",
    "extract_with",
    "input_sha256",
    "load_manifest",
    "plan_batches",
    "plan_shards",
    "quantize",
    "read_shard",
    "safetensors_chunks",
    "shard_keys",
    "shard_name",
    "states",
    "store_states",
    "verify_and_repair",
    "write_shard",
]
