"""The sglang backend's capture drafter (extract/sglang.py): a 1-layer EAGLE-3 drafter of zeros whose config names
the aux ids we want, in SGLang's convention for the target (docs/design.md §4). SGLang 0.5.17 takes the ids an
EAGLE3 server captures from its draft model's config, so this drafter makes the aux server capture our layers; it
is never used for anything else (requests ask for one new token, none is ever drafted)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3lib.engines.sglang import SGLANG_CONVENTION, sglang_config_ids
from eagle3lib.target.config import target_config_json

CAPTURE_DRAFT_ARCH = "LlamaForCausalLMEagle3"


def write_capture_drafter(target_dir, aux_layer_ids, out_dir, dtype=torch.bfloat16) -> Path:
    """A 1-layer EAGLE-3 drafter of zeros in SGLang's layout (midlayer.*) whose config names the
    aux ids (SGLang's convention for this target). SGLang takes the embeddings from the target."""
    text, arch = target_config_json(target_dir)
    H, V, L = int(text["hidden_size"]), int(text["vocab_size"]), int(text["num_hidden_layers"])
    ids = sglang_config_ids(aux_layer_ids, arch)
    head_dim = next((d for d in (128, 64, 32) if H % d == 0), H)
    heads, inter, dv = H // head_dim, 512, min(256, V)
    rope = text.get("rope_parameters") or {"rope_type": "default", "rope_theta": float(text.get("rope_theta", 10000.0))}
    config = {
        "architectures": [CAPTURE_DRAFT_ARCH],
        "model_type": "llama",
        "hidden_size": H,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "vocab_size": V,
        "draft_vocab_size": dv,
        "target_hidden_size": H,
        "num_hidden_layers": 1,
        "rms_norm_eps": float(text.get("rms_norm_eps", 1e-6)),
        "hidden_act": "silu",
        "max_position_embeddings": int(text.get("max_position_embeddings", 8192)),
        "rope_parameters": rope,
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": ids,
            "use_aux_hidden_state": True,
            "aux_layer_id_convention": SGLANG_CONVENTION,
        },
        "eagle3lib_capture_drafter": {
            "our_aux_layer_ids": [int(i) for i in aux_layer_ids],
            "target_architecture": arch,
            "target_num_layers": L,
            "note": "zeros: only makes SGLang capture these layers",
        },
    }
    shapes = {
        "input_layernorm.weight": [H],
        "hidden_norm.weight": [H],
        "post_attention_layernorm.weight": [H],
        "self_attn.q_proj.weight": [heads * head_dim, 2 * H],
        "self_attn.k_proj.weight": [heads * head_dim, 2 * H],
        "self_attn.v_proj.weight": [heads * head_dim, 2 * H],
        "self_attn.o_proj.weight": [H, heads * head_dim],
        "mlp.gate_proj.weight": [inter, H],
        "mlp.up_proj.weight": [inter, H],
        "mlp.down_proj.weight": [H, inter],
    }
    tensors = {
        f"midlayer.{n}": (torch.ones if n.endswith("norm.weight") else torch.zeros)(s, dtype=dtype)
        for n, s in shapes.items()
    }
    tensors.update(
        {
            "fc.weight": torch.zeros(H, 3 * H, dtype=dtype),
            "norm.weight": torch.ones(H, dtype=dtype),
            "lm_head.weight": torch.zeros(dv, H, dtype=dtype),
            "d2t": torch.zeros(dv, dtype=torch.int64),
            "t2d": torch.arange(V) < dv,
        }
    )
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
