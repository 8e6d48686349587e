"""Optional speedups of the drafter's training step: torch.compile of the decoder layer's elementwise parts
(train.compile_layer) and FP8 matmuls through torchao (train.float8)."""

from __future__ import annotations

import dataclasses

import torch

from eagle3lib.drafter import Drafter


def compile_decoder_layer(drafter: Drafter) -> None:
    """torch.compile the elementwise-heavy parts of a TTT step (norm, q/k/v sum, rotary; MLP with its
    SiLU·up; the merged attention's merge; the output norm before the loss), fusing what would otherwise
    be separate passes over [T, 14336]-sized activations. Bound methods are replaced, so parameter names
    stay as they were."""
    layer = drafter.layer
    layer.step_qkv = torch.compile(layer.step_qkv)
    layer.self_attn.output = torch.compile(layer.self_attn.output)  # with train.float8: o_proj's input scaling fused
    layer.finish = torch.compile(layer.finish)
    drafter.norm.forward = torch.compile(drafter.norm.forward)
    drafter.compile_merge = True


FLOAT8_MODULES = ("fc", "o_proj", "gate_proj", "up_proj", "down_proj")


def convert_to_float8(drafter: Drafter, emulate: bool = False) -> list[str]:
    """Train fc, o_proj and the MLP with FP8 matmuls (e4m3, row-wise dynamic scales: torchao's "rowwise"
    recipe): forward and both backward GEMMs at FP8 rate, master weights, optimizer and checkpoint as
    before. q/k/v run as two bf16 GEMMs of weight halves (Drafter.ttt_forward) and lm_head inside the
    fused loss, so they stay bf16. emulate: FP8 numerics without FP8 hardware (tests). Returns the names."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise RuntimeError("train.float8 needs torchao: pip install 'eagle3-workbook[fp8]' (or torchao)") from e
    if not emulate and not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
        raise RuntimeError(
            "train.float8 needs a GPU with FP8 matmuls (compute capability ≥ 8.9: Ada, Hopper, "
            "Blackwell); set train.float8: false here"
        )
    config = Float8LinearConfig.from_recipe_name("rowwise")
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    converted = []

    def wanted(module, name):
        if name.split(".")[-1] in FLOAT8_MODULES and module.in_features % 16 == 0 and module.out_features % 16 == 0:
            converted.append(name)
            return True
        return False

    convert_to_float8_training(drafter, config=config, module_filter_fn=wanted)
    return converted
