"""Canonical drafter checkpoint -> SGLang / vLLM / speculators layouts, and imports back (the load-back
gate, which checks an export with the engine's own code, is gate.py).

Layouts (docs/design.md §4), all with the same tensors and values, only names and config differ:
    canonical    layers.0.*, fc, norm, lm_head, d2t, t2d; config.json with our aux ids (HF hidden_states)
    sglang       layers.0. -> midlayer. (every SGLang release binds midlayer.*; releases before the
                 layers.0 rename drop layers.0.* without a word: acceptance length 1.0);
                 eagle_config ids in SGLang's convention = ours - 1
    vllm         the canonical layout; ids in vLLM's convention (= ours), also at the top level of
                 config.json, where vLLM's model runner looks first
    speculators  canonical tensor names and the target's embed_tokens.weight (speculators' own checkpoints carry
                 it, and speculators 0.9.0 leaves one a checkpoint lacks at zeros); config.json with
                 speculators_model_type "eagle3", transformer_layer_config, speculators_config naming the target
                 as speculators opens it (verifier_name_or_path), and the norm flags written explicitly

An MLA drafter (drafter/layer_kinds.py; TorchSpec's Eagle3DeepseekV2ForCausalLM for Kimi-K2.5) has the same
sglang and vllm layouts with its own layer tensors and architectures; both engines' loaders fuse q_a_proj and
kv_a_proj_with_mqa themselves, so they stay two tensors. It has no speculators layout (refused, saying why), and
the EAGLE-3.1 flags an engine's model of the layer ignores are refused for that engine (UNSERVED).

The engines' aux-id conventions, as read in their source, are told in engines/sglang.py and engines/vllm.py.

Every export carries eagle3.json (the target contract) and records our ids there.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

from safetensors.torch import save_file

from eagle3lib.drafter.config import VARIANTS
from eagle3lib.drafter.formats import WEIGHTS, llama_fields, read_config, read_variants, to_canonical
from eagle3lib.drafter.layer_kinds import LayerKind, layer_kind
from eagle3lib.engines.sglang import SGLANG_CONVENTION, SGLANG_VERSION, sglang_config_ids
from eagle3lib.target import (
    CONTRACT_FILE,
    default_cache_dir,
    load_config,
    load_head_tensors,
    load_tokenizer,
    make_contract,
    resolve_target,
    target_fingerprint,
    text_config,
)

ENGINES = ("sglang", "vllm", "speculators")
NO_TOKENIZER = SimpleNamespace(chat_template=None)  # a target without one: its contract has no chat-template hash
SPECULATORS_VERSION = "0.3.0"
# EAGLE-3.1 flags that an engine's model of a draft layer kind does not implement, so that it would serve another
# function than the one trained: {(engine, kind name): {flag: why}}.
_NBR_SGLANG = (
    "SGLang {v}'s {module} takes the layer's residual before hidden_norm whatever the config says; vLLM serves it"
)
UNSERVED = {
    ("sglang", "gqa"): {"norm_before_residual": _NBR_SGLANG.format(v=SGLANG_VERSION, module="llama_eagle3")},
    ("sglang", "mla"): {
        "norm_before_residual": _NBR_SGLANG.format(v=SGLANG_VERSION, module="kimi_k25_eagle3"),
        "norm_before_fc": f"SGLang {SGLANG_VERSION}'s kimi_k25_eagle3 (Eagle3MLAModel) has no input_norm before fc",
    },
    ("vllm", "mla"): {
        "norm_before_fc": "vLLM's deepseek_eagle3 (DeepseekV2Eagle3Model) has no input_norm before fc",
    },
}
# Config keys an engine's model of a draft layer kind needs set: {(engine, kind name): {key: why}}.
REQUIRED = {
    ("sglang", "mla"): {
        # kimi_k25_eagle3.py Eagle3MLADecoderLayer.__init__ raises without it
        "q_lora_rank": f"SGLang {SGLANG_VERSION}'s Eagle3MLADecoderLayer refuses an MLA layer without compressed "
        "queries ('Eagle3 MLA layer requires q_lora_rank in the draft config'); vLLM serves it",
    },
}

# What an engine's model of a draft layer kind needs of the target: {(engine, kind name): (test of the target's
# language-model config, why)}.
TARGET_REQUIRED = {
    ("vllm", "mla"): (
        lambda target_config: bool(getattr(target_config, "kv_lora_rank", None)),
        "vLLM 0.32 serves an MLA draft layer only beside an MLA target: its MLA attention metadata takes the head size "
        "from the target's config (MLACommonMetadataBuilder.build: model_config.get_head_size()), and MLA supports "
        "320, 512 or 576 only, an MLA target's latent width; over this target every request fails ('Head dimension "
        "64 is not supported by MLA' for SmolLM2). SGLang serves it (engine.name: sglang), or train the GQA layer "
        "(train.draft_attention: gqa)",
    ),
}


# ------------------------------------------------------------------------------- files ----


def _write_folder(out_dir, config: dict, tensors: dict, contract: dict) -> Path:
    """Write config.json, model.safetensors and eagle3.json into a temp sibling, then rename into place."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / CONTRACT_FILE).write_text(json.dumps(contract, indent=2, sort_keys=True) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


# ----------------------------------------------------------------------------- imports ----


def import_checkpoint(src_dir, out_dir, contract: dict | None = None, target=None, cache_dir=None) -> Path:
    """Read a canonical, vLLM, speculators or EAGLE/SpecForge (midlayer.*) checkpoint into the canonical form.

    Tensors keep their bytes (names only change; embed_tokens, which the engines take from the target,
    is dropped). The contract is `contract` (from the stage that knows the target), else src/eagle3.json, else
    built from `target` (target_contract).
    """
    if contract is not None:
        return _write_folder(out_dir, *to_canonical(src_dir, contract))
    return _write_folder(out_dir, *read_checkpoint(src_dir, target, cache_dir))


def target_contract(target, checkpoint_dir, cache_dir=None) -> dict:
    """The contract of a checkpoint that has no eagle3.json (speculators, EAGLE/SpecForge, TorchSpec), built from
    `target` (name, folder or hub id), the target it was trained for: fingerprint, architecture, hidden size,
    vocabulary and layer count from its config, the chat-template hash from its tokenizer where it has one (else
    None: not checked). The aux ids are left to the checkpoint's own config, translated from its format's
    convention by drafter/formats.py to_canonical, which also refuses a target the drafter does not fit."""
    where = resolve_target(str(target), Path(cache_dir or default_cache_dir()))
    config = load_config(where)
    try:
        tokenizer = load_tokenizer(where)
    except (OSError, ValueError, TypeError):  # a target folder without tokenizer files
        tokenizer = None
    name = str(Path(target).resolve()) if Path(target).is_dir() else str(target)  # later steps read it back
    placeholder = [1, 2, 3]  # valid on any target of 4+ layers; replaced below by the checkpoint's own ids
    contract = make_contract(
        name, SimpleNamespace(config=config), NO_TOKENIZER if tokenizer is None else tokenizer, placeholder, "float32"
    )
    drafter = read_config(checkpoint_dir)
    layer = drafter.get("transformer_layer_config") or {}
    contract.update(
        aux_layer_ids=None,
        dtype=drafter.get("torch_dtype") or drafter.get("dtype") or layer.get("torch_dtype") or layer.get("dtype"),
        chat_template_hash=None if tokenizer is None else contract["chat_template_hash"],
    )
    return contract


def read_checkpoint(checkpoint_dir, target=None, cache_dir=None) -> tuple[dict, dict, dict]:
    """(canonical config, tensors, contract) of a checkpoint of any layout we read: with its own eagle3.json, which
    `target` (when given) must match (check_target); without one, with the contract built from `target`."""
    if target is None or (Path(checkpoint_dir) / CONTRACT_FILE).is_file():
        config, tensors, contract = to_canonical(checkpoint_dir)  # without either: says to pass --target
        if target is not None:
            check_target(contract, target, cache_dir)
        return config, tensors, contract
    return to_canonical(checkpoint_dir, target_contract(target, checkpoint_dir, cache_dir))


# ----------------------------------------------------------------------------- exports ----


def check_target(contract: dict, target, cache_dir=None) -> None:
    """Refuse when `target` (name, folder or hub id) is not the target the contract names."""
    cache_dir = cache_dir or default_cache_dir()
    found = target_fingerprint(load_config(resolve_target(str(target), Path(cache_dir))))
    want = contract.get("target_fingerprint")
    if found != want:
        raise ValueError(
            f"Refusing to convert: the drafter was trained for target {contract.get('target')!r} (fingerprint "
            f"{want}), but {target!r} has fingerprint {found}. Convert for the target in the contract, or "
            "retrain the drafter on the new target."
        )


def verifier_name_or_path(target, cache_dir=None) -> str:
    """The target as another tool opens it (a speculators export's verifier.name_or_path): the embedded target and
    `tiny:` copies, names only this library resolves, as the folder they are built into in the cache (built if
    missing); a local folder as its absolute path; a hub id as it is."""
    name = str(target)
    if name.startswith(("embedded:", "tiny:")):
        name = resolve_target(name, Path(cache_dir or default_cache_dir()))
    path = Path(name).expanduser()
    return str(path.resolve()) if path.is_dir() else name


def export(checkpoint_dir, engine: str, out_dir, target=None, cache_dir=None, depth: int = 3) -> Path:
    """Write the `engine` layout of a checkpoint (any layout import_checkpoint reads) to out_dir.

    `target` (optional): refuse unless its config fingerprint equals the contract's; for a checkpoint without
        eagle3.json, the target it was trained for, whose contract (target_contract) the export carries. The
        speculators layout names it (else the contract's target) as its verifier and carries its embeddings.
    `depth`: speculative tokens recorded in the speculators config (vLLM reads it as the default).
    """
    if engine not in ENGINES:
        raise ValueError(f"Expected engine one of {ENGINES}, found {engine!r}.")
    config, tensors, contract = read_checkpoint(checkpoint_dir, target, cache_dir)
    refusal = export_refusal(engine, layer_kind(config), config, _target_text_config(target, cache_dir))
    if refusal:
        raise ValueError(f"Refusing to export {checkpoint_dir} for {engine}: {refusal}.")
    verifier = None
    if engine == "speculators":
        verifier = verifier_name_or_path(target if target is not None else contract["target"], cache_dir)
    cfg, out = engine_layout(engine, config, tensors, contract, depth, verifier)
    if engine == "speculators":
        out["embed_tokens.weight"] = _target_embeddings(checkpoint_dir, verifier)
    return _write_folder(out_dir, cfg, out, contract)


def _target_embeddings(checkpoint_dir, verifier: str):
    """The target's input embeddings, which the speculators layout carries as speculators' own checkpoints do:
    speculators 0.9.0 (transformers 5.19) leaves an embedding the checkpoint lacks at zeros, not at the NaN its
    load_verifier_weights looks for to fill it from the verifier."""
    try:
        return load_head_tensors(verifier)["embed"]
    except (OSError, KeyError) as e:
        raise ValueError(
            f"Refusing to export {checkpoint_dir} for speculators: the layout carries the target's embeddings, and "
            f"the target {verifier} has none to read ({type(e).__name__}: {e}). Give the target's folder with its "
            "weights (--target)."
        ) from e


def engine_layout(
    engine: str, config: dict, tensors: dict, contract: dict, depth: int = 3, verifier: str | None = None
) -> tuple[dict, dict]:
    """(config.json, tensors by the engine's names) of the `engine` layout of a canonical drafter (export's
    refusals not checked). Tensors are only renamed or dropped, so meta tensors do for a shapes-only export; d2t
    must hold values (a full vocabulary's is dropped for vLLM). `verifier`: the speculators layout's
    verifier.name_or_path (verifier_name_or_path), which it requires."""
    if engine == "speculators" and not verifier:
        raise ValueError("The speculators layout names its verifier: pass verifier= (verifier_name_or_path).")
    aux = contract["aux_layer_ids"]
    variants = read_variants(config)
    if engine == "sglang":
        cfg = copy.deepcopy(config)
        ids = sglang_config_ids(aux, contract.get("target_architecture"))
        cfg["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": ids,
            "use_aux_hidden_state": True,
            "aux_layer_id_convention": SGLANG_CONVENTION,
        }
        out = {
            ("midlayer." + n.removeprefix("layers.0.")) if n.startswith("layers.0.") else n: t
            for n, t in tensors.items()
        }
    elif engine == "vllm":
        cfg = copy.deepcopy(config)
        cfg["eagle_aux_hidden_state_layer_ids"] = list(aux)
        # eagle_config is the copy SGLang reads: in its convention, so that the folder serves the same layers there
        try:
            cfg["eagle_config"].update(
                eagle_aux_hidden_state_layer_ids=sglang_config_ids(aux, contract.get("target_architecture")),
                aux_layer_id_convention=SGLANG_CONVENTION,
            )
        except ValueError:  # layers SGLang cannot capture on this target: only vLLM's copy
            for key in ("eagle_aux_hidden_state_layer_ids", "aux_layer_id_convention"):
                cfg["eagle_config"].pop(key)
        out = dict(tensors)
    else:
        llama = llama_fields(config)
        llama.pop("architectures", None)
        cfg = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": llama,
            "draft_vocab_size": config["draft_vocab_size"],
            "target_hidden_size": config["target_hidden_size"],
            "eagle_aux_hidden_state_layer_ids": list(aux),
            # every flag written: speculators/vLLM default norm_before_residual to true when absent
            **{flag: bool(variants.get(flag)) for flag in VARIANTS},
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": int(depth),
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "verifier": {
                    "name_or_path": verifier,
                    "architectures": [contract.get("target_architecture") or "LlamaForCausalLM"],
                },
            },
            "torch_dtype": config.get("torch_dtype") or config.get("dtype") or "float32",
        }
        out = dict(tensors)
    if engine != "sglang" and _full_vocabulary(config, tensors):
        # vLLM's Eagle3 model has no draft_id_to_target_id for a full-vocabulary draft and refuses one
        out = {n: t for n, t in out.items() if n not in ("d2t", "t2d")}
    return cfg, out


def _target_text_config(target, cache_dir=None):
    """The language model's config of `target` (name, folder or hub id), or None when no target is given."""
    if target is None:
        return None
    return text_config(load_config(resolve_target(str(target), Path(cache_dir or default_cache_dir()))))


def export_refusal(engine: str, kind: LayerKind, config: dict, target_config=None) -> str | None:
    """Why `engine`'s layout cannot serve a drafter of this kind and config as trained, or None. With the
    target's language-model config, also what the engine needs of the target (TARGET_REQUIRED)."""
    if engine == "speculators" and kind.speculators_refusal:
        return f"its draft layer is {kind.name.upper()}, and {kind.speculators_refusal}"
    for flag, why in UNSERVED.get((engine, kind.name), {}).items():
        if read_variants(config).get(flag):
            return (
                f"the drafter was trained with the EAGLE-3.1 flag {flag}, which {engine} does not model ({why}): it "
                f"would serve another function at a lower acceptance. Export it for another engine, or train "
                f"with {flag} off"
            )
    for key, why in REQUIRED.get((engine, kind.name), {}).items():
        if not config.get(key):
            return f"its config has no {key}: {why}"
    serves, why = TARGET_REQUIRED.get((engine, kind.name), (None, None))
    if serves is not None and target_config is not None and not serves(target_config):
        return f"its draft layer is {kind.name.upper()} and the target's attention is not: {why}"
    return None


def exportable_engines(checkpoint_dir, target=None, cache_dir=None) -> dict[str, str | None]:
    """{engine: None, or why its layout cannot serve this checkpoint}, for every engine of ENGINES (with `target`,
    also over that target)."""
    config = _layer_config(checkpoint_dir)
    kind = layer_kind(config)
    target_config = _target_text_config(target, cache_dir)
    return {engine: export_refusal(engine, kind, config, target_config) for engine in ENGINES}


def _layer_config(checkpoint_dir) -> dict:
    """The config a checkpoint has, as far as the kind of its layer and its EAGLE-3.1 flags go (any layout)."""
    config = read_config(checkpoint_dir)
    layer = config.get("transformer_layer_config")
    flags = read_variants(config, speculators="speculators_model_type" in config)
    return {**(layer or config), "architectures": config.get("architectures"), **flags}


def _full_vocabulary(config: dict, tensors: dict) -> bool:
    """A draft over the target's whole vocabulary whose d2t is the identity (TorchSpec's Kimi-K2.5 drafter)."""
    d2t = tensors.get("d2t")
    return config.get("draft_vocab_size") == config.get("vocab_size") and (d2t is None or not bool(d2t.any()))
