"""train.init_from: start training from an existing drafter instead of a fresh one.

Any layout convert reads (docs/design.md §4): ours, speculators, or EAGLE/SpecForge midlayer.*. The drafter must
be for this run's target (its eagle3.json's fingerprint, or, for a foreign checkpoint without one, the target's
hidden size and vocabulary), read the same aux layers, and have this run's shapes (draft_vocab_size, dims). Its
draft vocabulary (d2t, t2d) comes with it: its lm_head rows belong to those tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3lib.drafter import Drafter, formats
from eagle3lib.target import CONTRACT_FILE
from eagle3lib.train import TrainingError

# What a foreign checkpoint (no eagle3.json) is checked against: the run's target (its architecture decides how
# an EAGLE/SpecForge config's SGLang ids translate, as in convert --target).
TARGET_KEYS = ("target", "target_fingerprint", "target_architecture", "num_layers", "hidden_size", "vocab_size")


def warm_start(drafter: Drafter, folder, contract: dict) -> dict:
    """Load the drafter at `folder` into `drafter` (this run's, built from `contract`, the run's target contract).
    Returns {init_from, layout, target}; raises TrainingError naming both sides when it does not fit."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise TrainingError(
            f"train.init_from: {folder} has no config.json; expected a drafter checkpoint folder "
            "(config.json + model.safetensors: 02_train/drafter, a speculators or an EAGLE/SpecForge drafter)"
        )
    layout = formats.detect_layout(folder)
    own_contract = (folder / CONTRACT_FILE).is_file()
    given = None if own_contract else {k: contract[k] for k in TARGET_KEYS if k in contract}
    try:
        config, tensors, theirs = formats.to_canonical(folder, given)
    except ValueError as e:
        raise TrainingError(f"train.init_from: {e}") from e
    problems = []
    if formats.read_variants(config) != drafter.cfg.variants:
        problems.append(
            f"its EAGLE-3.1 norms are {sorted(formats.read_variants(config)) or 'none'}, this run's "
            f"(train.eagle31_norms) {sorted(drafter.cfg.variants) or 'none'}"
        )
    if theirs.get("target_fingerprint") != contract.get("target_fingerprint"):
        problems.append(
            f"it was trained for target {theirs.get('target')!r} (fingerprint {theirs.get('target_fingerprint')}), "
            f"this run's target is {contract.get('target')!r} (fingerprint {contract.get('target_fingerprint')})"
        )
    if theirs["aux_layer_ids"] != contract["aux_layer_ids"]:
        problems.append(
            f"it reads target layers {theirs['aux_layer_ids']}, this run's hidden states are of layers "
            f"{contract['aux_layer_ids']} (target.aux_layer_ids)"
        )
    own = drafter.state_dict()
    problems += [
        f"{name} is {tuple(t.shape)} there, {tuple(own[name].shape)} here"
        for name, t in tensors.items()
        if name in own and own[name].shape != t.shape
    ]
    if problems:
        raise TrainingError(
            f"train.init_from {folder} ({layout} layout) does not fit this run: {'; '.join(problems)}. Start from a "
            "drafter of this target with the same train.draft_vocab_size, or leave train.init_from unset."
        )
    with torch.no_grad():
        drafter.load_state_dict({k: t.to(own[k].dtype) for k, t in tensors.items()}, strict=True)
    return {"init_from": str(folder), "layout": layout, "target": theirs.get("target")}
