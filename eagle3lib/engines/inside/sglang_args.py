"""The sglang extraction backend's launch flags through SGLang's own parser, in SGLang's interpreter.

    python eagle3lib/engines/inside/sglang_args.py '["--model-path", "T", "--enable-return-hidden-states", ...]'

Prints one JSON line: the resolved ServerArgs fields the backend relies on, and, for an EAGLE3
launch, the draft-config aux ids SGLang hands to the target's set_eagle3_layers_to_capture.
Standalone on purpose (stdlib and sglang only): SGLang pins its own transformers, so
eagle3lib.extract.sglang runs this file through a subprocess and never imports sglang itself.
Add `--device cpu` to the flags to run it on a machine without a GPU (no GPU work is done).
"""

import json
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

FIELDS = (
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
    "dtype",
    "tp_size",
    "device",
)


def check(argv):
    import sglang
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(argv)
    resolved = {k: getattr(server_args, k, None) for k in FIELDS}
    report = {
        "sglang_version": sglang.__version__,
        "resolved": resolved,
        "problems": [],
        "eagle_use_aux_hidden_state": False,
        "eagle_aux_hidden_state_layer_ids": None,
    }
    if server_args.speculative_algorithm:
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
        ids = aux.eagle_aux_hidden_state_layer_ids
        report["eagle_use_aux_hidden_state"] = bool(aux.eagle_use_aux_hidden_state)
        report["eagle_aux_hidden_state_layer_ids"] = list(ids) if ids is not None else None
        report["target_architectures"] = list(model_config.hf_config.architectures or [])
    return report


def main():
    argv = json.loads(sys.argv[1])
    try:
        report = check(argv)
    except BaseException as e:  # SystemExit from argparse included: the verdict, not a crash
        import traceback

        traceback.print_exc()
        report = {"problems": [f"SGLang refused the flags: {type(e).__name__}: {e}"], "resolved": {}}
    sys.stdout.flush()
    print(json.dumps(report, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
