"""A tiny random-weight copy of a model: `target.name: tiny:<model folder or hub id>`.

The copy keeps what the pipeline must get right for that model, the tokenizer files and chat template as they
are, the vocabulary, the architecture family and its rope, and shrinks what only costs compute: layers, hidden
and head sizes, experts. A multimodal wrapper (Kimi-K2.5's kimi_k25) becomes its language model (kimi_k2 as
DeepseekV3ForCausalLM, the class SGLang runs inside the wrapper); quantization is dropped. Built once per source
into the cache, like the embedded target.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "tiny:"
FORMAT_VERSION = 2  # bump when the shrinking changes: cached copies are rebuilt
# field -> its size in the copy (never larger than the source's)
SHRUNK = {
    "num_hidden_layers": 8,  # [2, L//2, L-3] = [2, 4, 5]: three distinct aux layers
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "n_routed_experts": 8,
    "num_local_experts": 8,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
}
# kept at the source's size: MLA's latent cache (kv_lora_rank + qk_rope_head_dim = 576 for DeepSeek-V3 and
# Kimi-K2.5) is the only size vLLM's CPU MLA kernel is built for
DROPPED = ("quantization_config", "auto_map", "head_dim", "_name_or_path", "transformers_version", "dtype",
           "torch_dtype", "architectures", "model_type")  # fmt: skip
TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "generation_config.json")  # fmt: skip


def source_files(source: str) -> Path:
    """A local folder as is; a hub id's config and tokenizer files (no weights) from the hub or its cache."""
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"Expected {path}/config.json for a tiny copy of {source}, found none.")
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(source, allow_patterns=["config.json", *TOKENIZER_FILES]))


def tiny_config(raw: dict):
    """The transformers config of the tiny copy of a config.json (see the module docstring)."""
    from transformers import AutoConfig

    from eagle3lib.target.config import TEXT_MODEL_FAMILY

    text = dict(raw.get("text_config") or raw)
    family = TEXT_MODEL_FAMILY.get(text.get("model_type"), text.get("model_type"))
    fields = {k: v for k, v in text.items() if k not in DROPPED}
    for key, size in SHRUNK.items():
        if isinstance(fields.get(key), int):
            fields[key] = min(fields[key], size)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        fields.setdefault(key, raw.get(key))
    config = AutoConfig.for_model(family, **fields)
    return config


def build(source: str, cache_dir) -> Path:
    """The tiny copy of `source` in cache_dir (built once; a folder whose marker differs is rebuilt)."""
    import torch
    from transformers import AutoModelForCausalLM

    src = source_files(source)
    digest = hashlib.sha256(f"{FORMAT_VERSION}".encode())
    for name in ("config.json", *TOKENIZER_FILES):
        if (src / name).is_file():
            digest.update(name.encode() + (src / name).read_bytes())
    marker = {"format_version": FORMAT_VERSION, "source": str(source), "sha256": digest.hexdigest()}
    final = Path(cache_dir) / f"tiny-{digest.hexdigest()[:16]}"
    if (final / "tiny-target.json").is_file() and json.loads((final / "tiny-target.json").read_text()) == marker:
        return final
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_dir))
    try:
        config = tiny_config(json.loads((src / "config.json").read_text()))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.config.architectures = [type(model).__name__]
        model.save_pretrained(tmp, safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        (tmp / "tiny-target.json").write_text(json.dumps(marker, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
