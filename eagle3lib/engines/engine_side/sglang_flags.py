"""SGLang's own resolution of our launch flags (load_check.py's sglang): prepare_server_args, i.e.
ServerArgs.__post_init__, and for an EAGLE3 launch the aux ids SGLang hands the target. Standalone (stdlib and
SGLang only)."""

# The ServerArgs fields the callers rely on: the deploy chain, and the extraction servers' hidden-state settings.
SGLANG_FIELDS = (
    "model_path",
    "enable_return_hidden_states",
    "return_hidden_states_mode",
    "disable_radix_cache",
    "chunked_prefill_size",
    "max_prefill_tokens",
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "trust_remote_code",
    "dtype",
    "tp_size",
    "device",
)
# Flags whose value SGLang must keep as asked (ServerArgs.__post_init__ may change them without a word).
SGLANG_ASKED = (
    ("--speculative-algorithm", "speculative_algorithm", str),
    ("--speculative-num-steps", "speculative_num_steps", int),
    ("--speculative-eagle-topk", "speculative_eagle_topk", int),
    ("--speculative-num-draft-tokens", "speculative_num_draft_tokens", int),
)


def check_sglang(argv):
    """SGLang's own resolution of these launch flags (prepare_server_args, i.e. ServerArgs.__post_init__) and,
    for a speculative launch, of the aux ids it will hand to the target's set_eagle3_layers_to_capture."""
    import sglang
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(argv)
    resolved = {k: getattr(server_args, k, None) for k in SGLANG_FIELDS}
    report = {
        "engine": "sglang",
        "problems": [],
        "sglang_version": sglang.__version__,
        "resolved": resolved,
        "eagle_use_aux_hidden_state": False,
        "eagle_aux_hidden_state_layer_ids": None,
    }
    for flag, field, kind in SGLANG_ASKED:
        asked = argv[argv.index(flag) + 1] if flag in argv[:-1] else None
        if asked is not None and resolved[field] != kind(asked):
            report["problems"].append(f"SGLang resolved {field} to {resolved[field]!r}, we asked for {kind(asked)!r}.")
    if not server_args.speculative_algorithm:
        return report

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    model_config = ModelConfig.from_server_args(server_args)
    aux = resolve_spec_aux_hidden_state_config(
        server_args=server_args,
        model_config=model_config,
        spec_algorithm=SpeculativeAlgorithm.from_string(server_args.speculative_algorithm),
        is_draft_worker=False,
    )
    draft_config = ModelConfig.from_server_args(
        server_args, model_path=server_args.speculative_draft_model_path, is_draft_model=True
    )
    ids = aux.eagle_aux_hidden_state_layer_ids
    report.update(
        eagle_use_aux_hidden_state=bool(aux.eagle_use_aux_hidden_state),
        # which HF layers these ids capture depends on the target's class (eagle3lib.engines.sglang.sglang_captured_ids)
        eagle_aux_hidden_state_layer_ids=list(ids) if ids is not None else None,
        target_architectures=list(model_config.hf_config.architectures or []),
        target_num_layers=model_config.num_hidden_layers,
        draft_architectures=list(draft_config.hf_config.architectures or []),
    )
    if not aux.eagle_use_aux_hidden_state:
        report["problems"].append(
            f"SGLang will not feed the target's aux hidden states with --speculative-algorithm "
            f"{server_args.speculative_algorithm}; an EAGLE-3 drafter needs EAGLE3."
        )
    return report
