"""The drafter checkpoint layouts we read, into the canonical form in memory (docs/design.md §4).

    canonical    layers.0.*, fc, norm, lm_head, d2t, t2d; config.json with our aux ids (HF hidden_states); what
                 02_train writes and what vLLM reads
    speculators  canonical tensor names; config.json with speculators_model_type "eagle3" and
                 transformer_layer_config
    specforge    EAGLE/SpecForge/TorchSpec (and SGLang exports): midlayer.* tensors, eagle_config ids in SGLang's
                 convention

Each layout holds either kind of draft layer (drafter/layer_kinds.py: GQA, or MLA as TorchSpec's Kimi-K2.5
drafters have it), known from the config's architectures; the kind names the tensors and their shapes.

convert/ writes each engine's layout from the canonical form and imports back through here; 02_train's
train.init_from warm-starts from any of them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3lib.drafter.config import VARIANTS
from eagle3lib.drafter.digests import check_digests
from eagle3lib.drafter.layer_kinds import LayerKind, layer_kind
from eagle3lib.target import AUX_LAYER_ID_CONVENTION, CONTRACT_FILE, check_aux_layer_ids, read_contract

LAYOUTS = ("canonical", "speculators", "specforge")
WEIGHTS = "model.safetensors"

# Canonical tensor names of a 1-layer GQA EAGLE-3 drafter (drafter/model.py); layer tensors under "layers.0.". An MLA
# drafter's are MLA.tensors(config) (drafter/layer_kinds.py): q_a_proj, q_a_layernorm, q_b_proj (q_proj without
# q_lora_rank), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj and o_proj in place of q/k/v/o_proj.
LAYER_TENSORS = (
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
TOP_TENSORS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")
CANONICAL_TENSORS = tuple("layers.0." + n for n in LAYER_TENSORS) + TOP_TENSORS
# Names other trainers give canonical tensors (after midlayer. -> layers.0.): TorchSpec's DeepSeekMLAAttention
# (torchspec/models/draft/deepseek_eagle.py) calls the KV down projection kv_a_proj; both engines bind only
# kv_a_proj_with_mqa (SGLang skips any other name without a word).
TENSOR_ALIASES = {"layers.0.self_attn.kv_a_proj.weight": "layers.0.self_attn.kv_a_proj_with_mqa.weight"}
# The config flags of EAGLE-3.1's norms (drafter/model.py VARIANTS); use_aux_norm is fc_norm's older name.
VARIANT_FLAGS = (*VARIANTS, "use_aux_norm")


def variant_tensors(variants: dict, n_aux: int = 3) -> tuple[str, ...]:
    """The tensors a drafter with these EAGLE-3.1 flags has beyond CANONICAL_TENSORS."""
    if variants.get("norm_before_fc"):
        return ("input_norm.weight",)
    if variants.get("fc_norm"):
        return tuple(f"fc_norm.{i}.weight" for i in range(n_aux))
    return ()


def read_variants(config: dict, speculators: bool = False) -> dict:
    """{flag: True} of the EAGLE-3.1 flags a drafter config turns on (flat, under eagle_config, or as
    use_aux_norm). A speculators config without norm_before_residual means True (its default)."""
    nested = config.get("eagle_config") or {}
    on = {f: bool(config.get(f, nested.get(f, False))) for f in VARIANTS}
    on["fc_norm"] = on["fc_norm"] or bool(config.get("use_aux_norm", nested.get("use_aux_norm", False)))
    if speculators and "norm_before_residual" not in config:
        on["norm_before_residual"] = True
    if on["norm_before_fc"] and on["fc_norm"]:
        raise ValueError("the config sets both norm_before_fc and fc_norm; a drafter has one or the other")
    return {f: True for f, v in on.items() if v}


def read_tensors(folder) -> dict:
    """All tensors of folder/model.safetensors (single file; no pickles)."""
    path = Path(folder) / WEIGHTS
    if not path.is_file():
        others = sorted(p.name for p in Path(folder).glob("*") if p.suffix in (".bin", ".pt", ".pth"))
        raise FileNotFoundError(
            f"Expected the drafter's weights in {path}, found {'only ' + ', '.join(others) if others else 'no such file'}. "
            "Only single-file safetensors checkpoints are read; convert pickled weights with the tool that "
            "wrote them (we never unpickle a file we did not write)."
        )
    try:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors' own error type names no file
        raise _unreadable(path, e) from e


def _unreadable(path: Path, error: Exception) -> ValueError:
    return ValueError(
        f"{path} is not a readable safetensors file ({type(error).__name__}: {error}): it was cut short or "
        "changed after it was written. Write it again (for 02_train's drafter: rerun the train stage)."
    )


def read_config(folder) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"Expected {path}, found no such file: is {folder} a drafter checkpoint folder?")
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------- layouts ----


def detect_layout(folder) -> str:
    """'canonical' (also our vllm export), 'speculators' or 'specforge' (EAGLE/SpecForge midlayer.*)."""
    config = read_config(folder)
    try:
        with safe_open(str(Path(folder) / WEIGHTS), "pt") as f:
            names = list(f.keys())
    except FileNotFoundError:
        read_tensors(folder)  # says what it found instead
        raise
    except Exception as e:
        raise _unreadable(Path(folder) / WEIGHTS, e) from e
    if "speculators_model_type" in config:
        return "speculators"
    if any(n.startswith("midlayer.") for n in names):
        return "specforge"
    if any(n.startswith("layers.0.") for n in names):
        return "canonical"
    raise ValueError(
        f"{folder}: cannot tell the checkpoint layout. Expected tensors under 'layers.0.' (canonical, vLLM, "
        f"speculators) or 'midlayer.' (EAGLE/SpecForge, SGLang), found {sorted(names)[:8]}... "
        "Check that the folder holds a 1-layer EAGLE-3 drafter."
    )


def engine_aux_ids(config: dict, architecture: str | None = None, num_layers: int = 0) -> dict[str, list[int]]:
    """The target layers (HF hidden_states indices) each engine captures for a drafter config, for each copy of
    the ids it has: vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` (HF indices, as speculators writes
    them), SGLang 0.5.17 reads `eagle_config`'s through the target class's rule (aux_ids.sglang_captured_ids)."""
    from eagle3lib.drafter.aux_ids import sglang_captured_ids

    out = {}
    if config.get("eagle_aux_hidden_state_layer_ids") is not None:
        out["vLLM"] = [int(i) for i in config["eagle_aux_hidden_state_layer_ids"]]
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        out["SGLang"] = sglang_captured_ids(ids, architecture, num_layers)
    return out


def aux_copies_disagree(config: dict, architecture: str | None = None, num_layers: int = 0) -> str | None:
    """What is wrong when config.json's two copies of the aux ids make vLLM and SGLang capture different target
    layers, else None."""
    captured = engine_aux_ids(config, architecture, num_layers)
    if len(captured) < 2 or captured["vLLM"] == captured["SGLang"]:
        return None
    return (
        f"config.json's two copies of the aux ids disagree: vLLM reads eagle_aux_hidden_state_layer_ids and "
        f"captures HF hidden_states {captured['vLLM']}; SGLang reads eagle_config.eagle_aux_hidden_state_layer_ids "
        f"{config['eagle_config']['eagle_aux_hidden_state_layer_ids']} and captures {captured['SGLang']} on a "
        f"{architecture or 'Llama-like'} target, so the same folder serves other layers in each engine. Re-export "
        "it with `python -m eagle3lib convert`, or correct the copy that is not the layers the drafter was trained on."
    )


def _aux_ids_from_config(config: dict, architecture: str | None = None, num_layers: int = 0) -> list[int] | None:
    """Aux ids in OUR convention from any of the layouts' configs, or None when the config has none. SGLang's
    ids (EAGLE/SpecForge checkpoints, our SGLang export) mean what SGLang 0.5.17 captures for them on the
    target's class (`architecture`): +1 on Llama-like targets, as they are on DeepSeek-V3 and Kimi-K2.5
    unless the first is 1. Refused when the config's two copies disagree (aux_copies_disagree)."""
    from eagle3lib.drafter.aux_ids import sglang_captured_ids

    problem = aux_copies_disagree(config, architecture, num_layers)
    if problem:
        raise ValueError(problem)
    eagle = config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    convention = eagle.get("aux_layer_id_convention")
    if ids is None:
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        convention = convention or AUX_LAYER_ID_CONVENTION  # vLLM / speculators: same meaning as ours
    if ids is None:
        return None
    if convention == AUX_LAYER_ID_CONVENTION:
        return [int(i) for i in ids]
    return sglang_captured_ids(ids, architecture, num_layers)  # SGLang / SpecForge


def llama_fields(config: dict) -> dict:
    """The flat Llama part of a drafter config (no EAGLE or speculators keys)."""
    drop = {
        "eagle_config",
        "eagle_aux_hidden_state_layer_ids",
        "draft_vocab_size",
        "target_hidden_size",
        "speculators_model_type",
        "speculators_config",
        "speculators_version",
        "transformer_layer_config",
        "auto_map",
        *VARIANT_FLAGS,
    }
    return {k: v for k, v in config.items() if k not in drop}


def _canonical_config(
    kind: LayerKind, fields: dict, draft_vocab_size: int, target_hidden_size: int, aux_ids: list[int], variants: dict
) -> dict:
    d = dict(fields)
    d.update(
        architectures=[kind.architecture],
        model_type=kind.model_type,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=target_hidden_size,
        num_hidden_layers=1,
        tie_word_embeddings=False,
        eagle_config={
            "eagle_aux_hidden_state_layer_ids": list(aux_ids),
            "aux_layer_id_convention": AUX_LAYER_ID_CONVENTION,
        },
        **variants,
    )
    return d


def renamed_tensors(tensors: dict, llama: dict, draft_vocab: int | None) -> tuple[dict, int]:
    """(tensors under their canonical names, the draft vocabulary's size): EAGLE's midlayer.*, SGLang's old aux norm
    names and aliases renamed, the target's embedding dropped, d2t and t2d made where a full vocabulary or d2t
    implies them."""
    renamed = {}
    for name, t in tensors.items():
        name = name.removeprefix("model.")
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        for legacy, i in (("aux_norm_low", 0), ("aux_norm_mid", 1), ("aux_norm_high", 2)):  # SGLang's old names
            name = name.replace(legacy, f"fc_norm.{i}")
        if name == "embed_tokens.weight":
            continue
        renamed[TENSOR_ALIASES.get(name, name)] = t
    if draft_vocab is None:
        draft_vocab = renamed["lm_head.weight"].shape[0] if "lm_head.weight" in renamed else llama.get("vocab_size")
    if "d2t" not in renamed and draft_vocab == llama.get("vocab_size"):
        renamed["d2t"] = torch.zeros(draft_vocab, dtype=torch.int64)  # full vocab: identity map
    if "t2d" not in renamed and "d2t" in renamed:
        t2d = torch.zeros(llama["vocab_size"], dtype=torch.bool)
        t2d[torch.arange(renamed["d2t"].numel()) + renamed["d2t"]] = True
        renamed["t2d"] = t2d
    return renamed, draft_vocab


def check_tensors(where: str, renamed: dict, shapes: dict, variants: dict) -> None:
    """Raise ValueError unless the renamed tensors are exactly those of `shapes`, each of its shape."""
    wanted = tuple(shapes)
    missing = [n for n in wanted if n not in renamed]
    extra = sorted(n for n in renamed if n not in wanted)
    if missing or extra:
        raise ValueError(
            f"{where}: expected the tensors {list(wanted)} "
            f"after renaming, missing {missing}, unexpected {extra} (EAGLE-3.1 flags: {sorted(variants) or 'none'}). "
            "It is not a 1-layer EAGLE-3 drafter of the layout we read."
        )
    misshapen = [f"{n} {tuple(renamed[n].shape)} (expected {s})" for n, s in shapes.items() if renamed[n].shape != s]
    if misshapen:
        raise ValueError(
            f"{where}: tensors of other shapes than its "
            f"config gives: {'; '.join(misshapen)}. The config does not belong to these weights."
        )


def fit_contract(src_dir, layout, config, contract, own, d2t, draft_vocab, target_hidden, llama) -> tuple[list, dict]:
    """(aux layer ids, the checkpoint's figures for the contract) once the checkpoint fits the contract: its own
    (own: read from its folder, which it must match) or the target's it is imported for."""
    aux = _aux_ids_from_config(config, contract.get("target_architecture"), contract.get("num_layers") or 0)
    if aux is None:
        layers = contract.get("num_layers")
        if not layers:
            raise ValueError(
                f"{src_dir}: no aux layer ids in its config and no num_layers in the contract; "
                "cannot know which target layers it reads. Add eagle_aux_hidden_state_layer_ids."
            )
        aux = [2, layers // 2, layers - 3]  # the engines' default, same in every convention
    if contract.get("aux_layer_ids") not in (None, aux):
        raise ValueError(
            f"{src_dir}: its config reads target layers {aux} (HF hidden_states indexing) but the "
            f"contract says {contract['aux_layer_ids']}; fix the config or the contract."
        )
    from eagle3lib.drafter.vocab import d2t_sha256

    found = {
        "draft_vocab_size": int(draft_vocab),
        "d2t_sha256": d2t_sha256(d2t),
        "hidden_size": int(target_hidden),
        "vocab_size": llama.get("vocab_size"),
    }
    who, whose = ("contract", "its contract") if own else ("target", f"target {contract.get('target')!r}")
    bad = [
        f"{k}: {who} {contract[k]!r}, checkpoint {v!r}" for k, v in found.items() if contract.get(k) not in (None, v)
    ]
    if own and bad:
        raise ValueError(
            f"{src_dir}: the checkpoint does not match its contract ({'; '.join(bad)}). It was changed "
            "after training or the contract belongs to another drafter; re-export from the trained checkpoint."
        )
    if contract.get("num_layers"):
        try:
            check_aux_layer_ids(aux, contract["num_layers"])
        except ValueError:
            bad.append(
                f"aux_layer_ids: the checkpoint reads target layers {aux} (HF hidden_states indexing), the "
                f"{who} has {contract['num_layers']} layers (aux layers lie in 1..{contract['num_layers'] - 1})"
            )
    if bad:
        raise ValueError(
            f"{src_dir} ({layout} layout) does not fit {whose} ({'; '.join(bad)}). Give the target this drafter "
            "was trained for."
        )
    return aux, found


def to_canonical(src_dir, contract: dict | None = None) -> tuple[dict, dict, dict]:
    """(canonical config, canonical tensors, contract) of any layout import_checkpoint reads, in memory."""
    src_dir = Path(src_dir)
    layout = detect_layout(src_dir)
    config, tensors = read_config(src_dir), read_tensors(src_dir)  # a torn file is named as torn first
    check_digests(src_dir)  # then a changed byte, which would read as other weights
    own = contract is None
    if own:
        if not (src_dir / CONTRACT_FILE).is_file():
            verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
            raise FileNotFoundError(
                f"{src_dir} ({layout} layout) has no {CONTRACT_FILE} (target contract): pass --target TARGET_DIR, "
                "the target this drafter was trained for (a Hugging Face folder or hub id; target= in Python), and "
                "the contract is built from it." + (f" Its config names the verifier {verifier!r}." if verifier else "")
            )
        contract = read_contract(src_dir)
    contract = dict(contract)

    if layout == "speculators":
        llama = dict(config.get("transformer_layer_config") or {})
        draft_vocab = config.get("draft_vocab_size")
        target_hidden = config.get("target_hidden_size") or llama.get("hidden_size")
    else:
        llama = llama_fields(config)
        draft_vocab = config.get("draft_vocab_size")
        target_hidden = config.get("target_hidden_size") or config.get("hidden_size")
    variants = read_variants(config, speculators=layout == "speculators")
    kind = layer_kind(config)
    absent = kind.missing_keys(llama)
    if absent:
        raise ValueError(
            f"{src_dir} ({layout} layout): its config names a {kind.name.upper()} drafter "
            f"({config.get('architectures')}) but has no {absent}; the draft layer's shapes come from them."
        )

    renamed, draft_vocab = renamed_tensors(tensors, llama, draft_vocab)
    shapes = kind.shapes({**llama, "draft_vocab_size": draft_vocab, "target_hidden_size": target_hidden}, variants)
    check_tensors(f"{src_dir} ({layout} layout, {kind.name.upper()} draft layer)", renamed, shapes, variants)
    wanted = tuple(shapes)
    aux, found = fit_contract(src_dir, layout, config, contract, own, renamed["d2t"], draft_vocab, target_hidden, llama)
    contract.update(found, aux_layer_ids=aux, aux_layer_id_convention=AUX_LAYER_ID_CONVENTION)
    out = {n: renamed[n] for n in wanted}
    return _canonical_config(kind, llama, int(draft_vocab), int(target_hidden), aux, variants), out, contract
