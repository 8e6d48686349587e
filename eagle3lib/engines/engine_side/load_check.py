"""Engine-side load-back checks, run in the engine's own interpreter (.venv-vllm / .venv-sglang).

    python eagle3lib/engines/engine_side/load_check.py vllm DRAFT_DIR --target TARGET_DIR [--depth D]
    python eagle3lib/engines/engine_side/load_check.py sglang --args '[...launch flags...]'
    python eagle3lib/engines/engine_side/load_check.py vllm-forward DRAFT_DIR --target TARGET_DIR --inputs IN --out OUT
    python eagle3lib/engines/engine_side/load_check.py vllm-meta CONFIG_DIR --target TARGET_DIR --shapes SHAPES_JSON

The work is in this folder's vllm_load.py, vllm_forward.py and sglang_flags.py; this file picks one and prints
its report as one JSON line. Standalone on purpose (stdlib, torch, safetensors and the engine only):
the engines pin transformers versions that our .venv does not have, so eagle3lib.engines.interpreter runs this
file through a subprocess and never imports an engine itself.

vllm: builds the VllmConfig that `vllm serve TARGET --speculative-config {...}` would build, loads the
    draft with vLLM's own model loader (get_model -> Eagle3LlamaForCausalLM.load_weights) on the CPU,
    and compares every parameter with the checkpoint's tensors (q/k/v and gate/up fused as vLLM does).
    AutoWeightsLoader raises on a name it cannot place; a parameter left unloaded shows as a mismatch.
sglang: resolves the launch flags with SGLang's own prepare_server_args (ServerArgs.__post_init__) and, for
    an EAGLE3 launch, reads the aux ids SGLang will hand to the target's set_eagle3_layers_to_capture. The
    deploy, convert and extraction checks all use it; add `--device cpu` to run it without a GPU.
vllm-meta: the draft model vLLM builds from CONFIG_DIR/config.json, on the meta device (no memory: a full-size
    drafter on any host), and its own load_weights fed meta tensors of the names and shapes in SHAPES_JSON
    ({name: shape}): vLLM's weight loaders assert every shape; AutoWeightsLoader refuses a name it cannot place.
vllm-forward: the draft's forward in vLLM's own Eagle3LlamaForCausalLM (Eagle3DeepseekV2ForCausalLM for an MLA
    draft) on given inputs (attention over the one sequence by plain causal softmax in place of the engine's
    kernels), to compare with our Drafter.step.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# siblings in this folder, which Python puts first on sys.path when it runs this file
from report import answer, refusal  # noqa: E402
from sglang_flags import check_sglang  # noqa: E402
from vllm_forward import forward_vllm  # noqa: E402
from vllm_load import check_vllm, meta_vllm  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", choices=["vllm", "sglang", "vllm-forward", "vllm-meta"])
    ap.add_argument("draft", nargs="?", help="vllm: the export folder (sglang: the flags name it)")
    ap.add_argument("--target")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--args", help="JSON list of SGLang launch flags")
    ap.add_argument("--inputs", help="vllm-forward: safetensors with input_embeds, aux, positions")
    ap.add_argument("--out", help="vllm-forward: where its logits and pre-norm hidden state go")
    ap.add_argument("--shapes", help="vllm-meta: JSON {tensor name: shape} to load")
    a = ap.parse_args(argv)
    try:
        if a.engine == "vllm":
            report = check_vllm(a.draft, a.target, a.depth)
        elif a.engine == "vllm-meta":
            report = meta_vllm(a.draft, a.target, a.shapes)
        elif a.engine == "vllm-forward":
            report = forward_vllm(a.draft, a.target, a.inputs, a.out)
        else:
            report = check_sglang(json.loads(a.args))
    except BaseException as e:  # the engine refusing (argparse's SystemExit included) is the verdict, not a crash
        import traceback

        traceback.print_exc()
        verdict = "SGLang refused the flags" if a.engine == "sglang" else "vllm could not build or load the draft"
        report = refusal(a.engine, verdict, e, captured_hf_layers=None, resolved={})
    return answer(report)


if __name__ == "__main__":
    sys.exit(main())
