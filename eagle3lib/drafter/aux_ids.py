"""Aux layer ids in each engine's convention. Ours (and vLLM's, speculators'): Hugging Face `hidden_states`
indices, id i = the residual stream after i decoder layers. SGLang 0.5.17's draft-config ids are turned into
captured layers by the target class's `set_eagle3_layers_to_capture` (docs/design.md §4): the two functions
below hold that rule, one the inverse of the other. A base module, so that reading a foreign checkpoint
(drafter/formats.py) and the SGLang engine code share it.
"""

from __future__ import annotations

# Targets whose SGLang 0.5.17 set_eagle3_layers_to_capture adds 1 to the config ids only when the first
# id is 1 and takes any other ids as HF indices (Llama-like targets always add 1).
SGLANG_FIRST_ID_RULE = {
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    "KimiK25ForConditionalGeneration",
    "Glm4MoeLiteForCausalLM",
}


def sglang_config_ids(ours, architecture: str | None) -> list[int]:
    """The draft-config ids that make SGLang 0.5.17 capture our (HF hidden_states) ids on this target."""
    ours = [int(i) for i in ours]
    if architecture in SGLANG_FIRST_ID_RULE:
        if ours[0] == 2:
            return [i - 1 for i in ours]  # j[0] == 1: SGLang adds 1
        if ours[0] >= 3:
            return list(ours)  # j[0] != 1: SGLang takes them as they are
        raise ValueError(
            f"aux_layer_ids {ours}: SGLang 0.5.17 cannot capture HF index 1 on {architecture} (its "
            f"set_eagle3_layers_to_capture maps a first id 1 to 2 and keeps any other as is); "
            f"start the ids at 2 or more"
        )
    return [i - 1 for i in ours]


def sglang_captured_ids(config_ids, architecture: str | None, num_layers: int) -> list[int]:
    """The HF hidden_states indices SGLang 0.5.17 captures for these draft-config ids (None: its default)."""
    if config_ids is None:
        return [2, num_layers // 2, num_layers - 3]
    ids = [int(j) for j in config_ids]
    if architecture in SGLANG_FIRST_ID_RULE and not (ids and ids[0] == 1):
        return ids
    return [j + 1 for j in ids]
