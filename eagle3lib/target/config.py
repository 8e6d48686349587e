"""The target's config read without its weights: transformers' own, or a multimodal wrapper's read without its
remote code (Kimi-K2.5), its layer count, and the aux-layer ids a run captures.

Aux layer ids use Hugging Face `hidden_states` indexing (docs/design.md §4): id i is the residual
stream after i decoder layers, 0 is the embeddings, L (the last one) the final pre-norm state.
"""

import json
import os
from pathlib import Path

AUX_LAYER_ID_CONVENTION = "hf_hidden_states"

# Text models of multimodal wrappers that transformers knows under another name (same weights and shapes).
TEXT_MODEL_FAMILY = {"kimi_k2": "deepseek_v3"}


class WrapperConfig:
    """A multimodal wrapper's config read without its remote code (e.g. Kimi-K2.5's kimi_k25): the wrapper's
    own fields as they are in config.json, and `text_config`, the language model's config as the transformers
    class of its family (kimi_k2 -> DeepseekV3Config)."""

    def __init__(self, raw: dict):
        from transformers import AutoConfig

        self.raw = raw
        self.model_type = raw.get("model_type")
        self.architectures = raw.get("architectures") or [None]
        text = dict(raw["text_config"])
        family = TEXT_MODEL_FAMILY.get(text.get("model_type"), text.get("model_type"))
        fields = {k: v for k, v in text.items() if k not in ("model_type", "auto_map", "architectures")}
        try:
            self.text_config = AutoConfig.for_model(family, **fields)
        except ValueError as e:
            raise ValueError(
                f"Expected the text_config of {self.model_type} to be a model type transformers knows (or one of "
                f"{sorted(TEXT_MODEL_FAMILY)}), found {text.get('model_type')!r}: {e}"
            ) from e
        self.text_config.architectures = text.get("architectures")
        self.quantization_config = text.get("quantization_config") or raw.get("quantization_config")

    def to_dict(self) -> dict:
        return self.raw


def load_config(where, trust_remote_code: bool = False):
    """The target's config: AutoConfig's, or where transformers does not know the model type and the folder's
    config.json wraps a text model (Kimi-K2.5), a WrapperConfig read without remote code."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(where, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError) as e:
        path = Path(where) / "config.json"
        raw = json.loads(path.read_text()) if path.is_file() else {}
        if "text_config" not in raw:
            raise
        try:
            return WrapperConfig(raw)
        except ValueError as inner:
            raise inner from e


def target_config_json(target_dir):
    """(the text model's config dict, architecture) read from target_dir/config.json as JSON, without
    importing the model's code (engines load the target in their own processes)."""
    path = os.path.join(str(target_dir), "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} not found: an engine backend needs the target as a local Hugging Face "
            f"folder (the embedded target resolves to its cache folder)"
        )
    with open(path) as f:
        cfg = json.load(f)
    return (cfg.get("text_config") or cfg), (cfg.get("architectures") or ["?"])[0]


# ---------------------------------------------------------------------------------------
# Aux layer ids (HF hidden_states indexing)


def text_config(config):
    """The language model's config of a multimodal wrapper (text_config), else the config itself."""
    return getattr(config, "text_config", None) or config


def num_layers(config) -> int:
    """Number of decoder layers of the (text) model."""
    n = getattr(text_config(config), "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"Expected the config to have num_hidden_layers >= 1, found {n!r} in {type(config).__name__}.")
    return n


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's capture points [2, L//2, L-3] in HF hidden_states indexing."""
    ids = [2, num_layers // 2, num_layers - 3]
    check_aux_layer_ids(ids, num_layers)
    return ids


def check_aux_layer_ids(ids, num_layers: int) -> list[int]:
    """Aux ids must be 3 distinct increasing ints in 1..L-1; returns them as a list.

    0 is the token embeddings (the drafter has them already) and L is the final pre-norm
    state, which EAGLE-3 feeds separately, not as an aux layer.
    """
    ids = list(ids)
    if (
        len(ids) != 3
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        or not all(a < b for a, b in zip(ids, ids[1:]))
        or ids[0] < 1
        or ids[-1] > num_layers - 1
    ):
        raise ValueError(
            f"Expected aux_layer_ids to be 3 distinct increasing integers in 1..{num_layers - 1} "
            f"(Hugging Face hidden_states indexing: id i = residual stream after i of the target's "
            f"{num_layers} layers; 0 is the embeddings and {num_layers} the final state, neither is an "
            f"aux layer), found {ids!r}. Use the default {[2, num_layers // 2, num_layers - 3]} or fix the params."
        )
    return ids


def aux_layer_ids(requested, num_layers: int) -> list[int]:
    """The aux ids a run captures: `requested` (target.aux_layer_ids in the params) when given, else the
    default; checked against the target's layer count either way."""
    return check_aux_layer_ids(requested or default_aux_layer_ids(num_layers), num_layers)
