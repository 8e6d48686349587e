"""The target contract (`eagle3.json`), written beside every shard set and checkpoint; later stages
compare it with what they expect and refuse inputs made for another target.
"""

import hashlib
import json
import os
from pathlib import Path

from eagle3lib.target.config import AUX_LAYER_ID_CONVENTION, check_aux_layer_ids, num_layers, text_config
from eagle3lib.target.loading import dtype_name

CONTRACT_FILE = "eagle3.json"

# Config fields that say nothing about the network itself (library version, where it was
# loaded from, storage dtype, how it was quantized on disk, runtime switches).
VOLATILE_CONFIG_FIELDS = {
    "transformers_version",
    "_name_or_path",
    "name_or_path",
    "_model_name_or_path",
    "torch_dtype",
    "dtype",
    "quantization_config",
    "architectures",
    "use_cache",
    "_commit_hash",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "_experts_implementation",
    "attn_implementation",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "torchscript",
    "auto_map",
}


def _strip_volatile(d):
    if isinstance(d, dict):
        return {k: _strip_volatile(v) for k, v in d.items() if k not in VOLATILE_CONFIG_FIELDS}
    if isinstance(d, (list, tuple)):
        return [_strip_volatile(v) for v in d]
    return d


def target_fingerprint(config) -> str:
    """sha256 of the config's architecture-defining fields (volatile fields dropped) as sorted JSON."""
    fields = _strip_volatile(config.to_dict())
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def chat_template_hash(tokenizer) -> str:
    """sha256 of the tokenizer's chat template (a string, or a dict of named templates)."""
    return hashlib.sha256(json.dumps(tokenizer.chat_template, sort_keys=True).encode()).hexdigest()


def make_contract(target_name: str, model, tokenizer, aux_layer_ids, dtype) -> dict:
    config = text_config(model.config)
    layers = num_layers(model.config)
    return {
        "target": target_name,
        "target_fingerprint": target_fingerprint(model.config),
        "target_architecture": (getattr(model.config, "architectures", None) or [None])[0],  # engines' layer-id rules
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "num_layers": layers,
        "aux_layer_ids": check_aux_layer_ids(aux_layer_ids, layers),
        "aux_layer_id_convention": AUX_LAYER_ID_CONVENTION,
        "dtype": dtype_name(dtype),
        "chat_template_hash": chat_template_hash(tokenizer),
        "draft_vocab_size": None,
        "d2t_sha256": None,
    }


def write_contract(dir, contract: dict) -> Path:
    """Write `dir/eagle3.json` atomically."""
    path = Path(dir) / CONTRACT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{CONTRACT_FILE}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(contract, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def read_contract(dir) -> dict:
    path = Path(dir) / CONTRACT_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"Expected a target contract {path}, found none. The folder was not written by this "
            "pipeline or its stage did not finish; rerun the stage that produces it."
        )
    return json.loads(path.read_text())


def check_contract(expected: dict, found: dict, where: str) -> None:
    """Raise ValueError listing every key whose expected (non-None) value differs in `found`."""
    missing = object()
    bad = []
    for key, want in expected.items():
        if want is None:
            continue
        got = found.get(key, missing)
        # Compare through JSON so tuples and lists (or a contract read from disk) compare equal.
        if got is missing or json.dumps(want, sort_keys=True) != json.dumps(got, sort_keys=True):
            bad.append(f"  {key}: expected {want!r}, found {'(missing)' if got is missing else repr(got)}")
    if bad:
        raise ValueError(
            f"{where} was made for a different target setup ({CONTRACT_FILE} does not match):\n"
            + "\n".join(bad)
            + f"\nRerun the stage that produced {where} with the current params, or point this stage "
            "at inputs made with the same target, aux layers, dtype and chat template."
        )
