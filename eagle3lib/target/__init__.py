"""The target model, as every stage sees it:

    loading.py             the model, its tokenizer and its config without weights (HF folder, hub id, the
                           embedded SmolLM2, a tiny copy), the frozen tensors a drafter takes from it
    config.py              config.json read without remote code (multimodal wrappers), layer count, aux-layer ids
    contract.py            eagle3.json: what a shard set or checkpoint was made for, checked by later stages
    tiny.py                tiny random-weight copies of real configs and tokenizers (tests, CI)
    tiktoken_tokenizer.py  Kimi's tiktoken tokenizer and chat template, without its remote code
    tool_declarations.py   tool schemas as the TypeScript declarations Kimi's template renders

The names below are the package's public API (`from eagle3lib import target; target.load_target(...)`).
"""

from eagle3lib.target.config import (
    AUX_LAYER_ID_CONVENTION,
    TEXT_MODEL_FAMILY,
    WrapperConfig,
    aux_layer_ids,
    check_aux_layer_ids,
    default_aux_layer_ids,
    load_config,
    num_layers,
    target_config_json,
    text_config,
)
from eagle3lib.target.contract import (
    CONTRACT_FILE,
    VOLATILE_CONFIG_FIELDS,
    chat_template_hash,
    check_contract,
    make_contract,
    read_contract,
    target_fingerprint,
    write_contract,
)
from eagle3lib.target.loading import (
    CACHE_FORMAT_VERSION,
    CACHE_MARKER,
    EMBEDDED_DIR_NAME,
    EMBEDDED_TARGET,
    default_cache_dir,
    dtype_name,
    embedded_gguf_path,
    embedded_target_dir,
    load_head_tensors,
    load_layer_tensors,
    load_target,
    load_target_info,
    load_tokenizer,
    resolve_target,
    torch_dtype,
)

__all__ = [
    "AUX_LAYER_ID_CONVENTION",
    "CACHE_FORMAT_VERSION",
    "CACHE_MARKER",
    "CONTRACT_FILE",
    "EMBEDDED_DIR_NAME",
    "EMBEDDED_TARGET",
    "TEXT_MODEL_FAMILY",
    "VOLATILE_CONFIG_FIELDS",
    "WrapperConfig",
    "aux_layer_ids",
    "chat_template_hash",
    "check_aux_layer_ids",
    "check_contract",
    "default_aux_layer_ids",
    "default_cache_dir",
    "dtype_name",
    "embedded_gguf_path",
    "embedded_target_dir",
    "load_config",
    "load_head_tensors",
    "load_layer_tensors",
    "load_target",
    "load_target_info",
    "load_tokenizer",
    "make_contract",
    "num_layers",
    "read_contract",
    "resolve_target",
    "target_config_json",
    "target_fingerprint",
    "text_config",
    "torch_dtype",
    "write_contract",
]
