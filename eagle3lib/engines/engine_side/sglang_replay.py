"""SGLang's own code on our exports, run in SGLang's interpreter (.venv-sglang, CPU): the load-back and the
aux-layer capture that eagle3lib.convert.gate and eagle3lib.engines.sglang restate in pure Python.

    python eagle3lib/engines/engine_side/sglang_replay.py load EXPORT_DIR [--dtype float32]
    python eagle3lib/engines/engine_side/sglang_replay.py capture ARCH NUM_LAYERS IDS_JSON [ARCH NUM_LAYERS IDS_JSON ...]
    python eagle3lib/engines/engine_side/sglang_replay.py meta-load CONFIG_DIR SHAPES_JSON

Prints one JSON report line (last line of stdout). The load is in this folder's sglang_load.py, the meta-load in
sglang_meta_load.py, both over sglang_model.py; the capture is here. Standalone on purpose (stdlib, torch, safetensors and
SGLang only), like load_check.py: eagle3lib.engines.interpreter.run_engine_side runs it.

load: SGLang's draft-model path up to its weights: ServerArgs (device cpu) published as the process's
    server args, a world-size-1 gloo process group, ModelConfig.from_server_args(..., is_draft_model=True),
    the class SGLang's registry picks from config.json's architectures (get_model_architecture), built by
    its _initialize_model on the CPU, and DefaultModelLoader's own safetensors iterator fed to its
    load_weights_and_postprocess (i.e. LlamaForCausalLMEagle3.load_weights). Nothing of SGLang is
    re-implemented: every parameter starts as NaN and, as SGLang's loader takes our tensors one at a time,
    the script records which parameter rows each tensor changed (and the shard id SGLang's weight_loader
    got), then compares the loaded rows with the file's tensor. Report:
        {ok, problems, how, model_class, params: {name: {shape, bound_from: [{tensor, shard, rows, equal}],
         fully_bound}}, tensors: {name: [parameter[shard], ...]}, dropped, hot_token_id_ok, ...}
    how: "real model on cpu" when SGLang's constructor runs as installed. On a CPU-only host without the
    CPU engine (SGLANG_USE_CPU_ENGINE, which needs sgl_kernel's CPU build), RotaryEmbedding.__init__
    imports vllm._custom_ops.rotary_embedding as its fallback forward kernel; when that import fails the
    model is built again with only that one function stubbed (it runs in forward, never at load), and
    `how` and `construct_note` say so. An MLA draft (kimi_k25_eagle3's Eagle3DeepseekV2ForCausalLM) with a plain
    rope gets the factory's get_rope, as on a GPU: the CPU one asserts DeepSeek's YaRN (sglang_model.py's plain_rope_on_cpu). Its
    loader fuses q_a_proj and kv_a_proj_with_mqa when the second comes; the report attributes the rows to both.
meta-load: the same model built from CONFIG_DIR/config.json on the meta device (no memory: a full-size drafter,
    Kimi-K2.5's hidden 7168, on any host), and its own load_weights fed meta tensors of the names and shapes in
    SHAPES_JSON ({name: shape}; d2t as real zeros, its loader adds an arange to it): SGLang's weight loaders assert
    every shape. Report: {ok, problems, model_class, params: {name: shape}, loaded_into: {tensor: [param[shard]]},
    unloaded: [params no tensor reached, but embed_tokens], dropped: [tensors no parameter took, but t2d]}.
capture: SGLang's own set_eagle3_layers_to_capture for ARCH (resolved by SGLang's ModelRegistry, as the
    server does) on an instance made without its __init__ (nn.Module's only), holding the attributes the
    method reads: pp_group, config.num_hidden_layers, model. A multimodal wrapper (KimiK25ForConditionalGeneration)
    gets as language_model a bare instance of the class its __init__ builds (looked up in its own module), so
    SGLang's delegation runs. IDS_JSON: a list of ids, or null (SGLang's default). Report:
        {ok, problems, cases: [{arch, num_layers, ids, model_class, language_model_class, layers_to_capture}],
         layers_to_capture (the first case's)}
"""

import json
import os
import sys
import traceback
from types import SimpleNamespace as NS

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Multimodal wrappers whose set_eagle3_layers_to_capture delegates to self.language_model: the name of the class
# their __init__ builds it from (looked up in the wrapper's own module, so it is the class SGLang instantiates).
LANGUAGE_MODEL_CLASS = {"KimiK25ForConditionalGeneration": "DeepseekV3ForCausalLM"}

# siblings in this folder, which Python puts first on sys.path when it runs this file
from sglang_load import load_report  # noqa: E402
from sglang_meta_load import meta_load_report  # noqa: E402

# ------------------------------------------------------------------------------------------- capture ----


def _bare(cls, num_layers):
    """An instance of an SGLang model class without its __init__ (nn.Module's only), holding what
    set_eagle3_layers_to_capture reads."""
    import torch

    obj = cls.__new__(cls)
    torch.nn.Module.__init__(obj)
    obj.pp_group = NS(is_last_rank=True)
    obj.config = NS(num_hidden_layers=num_layers)
    obj.model = NS()  # KimiK25ForConditionalGeneration.__setattr__ ignores it: its .model is language_model
    return obj


def capture_report(cases):
    import sglang
    from sglang.srt.models.registry import ModelRegistry

    problems, out = [], []
    for arch, num_layers, ids in cases:
        cls, _ = ModelRegistry.resolve_model_cls([arch])
        me = _bare(cls, num_layers)
        lm_name = LANGUAGE_MODEL_CLASS.get(cls.__name__)
        if lm_name is not None:
            me.language_model = _bare(getattr(sys.modules[cls.__module__], lm_name), num_layers)
        cls.set_eagle3_layers_to_capture(me, ids)
        inner = me.language_model if lm_name is not None else me
        layers = getattr(inner.model, "layers_to_capture", None)
        if layers is None:
            problems.append(f"{arch}.set_eagle3_layers_to_capture({ids}) set no layers_to_capture.")
        out.append(
            {
                "arch": arch,
                "num_layers": num_layers,
                "ids": ids,
                "model_class": f"{cls.__module__}.{cls.__name__}",
                "language_model_class": type(inner).__name__ if lm_name is not None else None,
                "capture_aux_hidden_states": bool(getattr(inner, "capture_aux_hidden_states", False)),
                "layers_to_capture": list(layers) if layers is not None else None,
            }
        )
    return {
        "mode": "capture",
        "ok": not problems,
        "problems": problems,
        "sglang_version": sglang.__version__,
        "cases": out,
        "layers_to_capture": out[0]["layers_to_capture"] if out else None,
    }


def _parse_cases(args):
    if not args or len(args) % 3:
        raise SystemExit("capture takes ARCH NUM_LAYERS IDS_JSON, one or more times")
    cases = []
    for i in range(0, len(args), 3):
        ids = json.loads(args[i + 2])
        cases.append((args[i], int(args[i + 1]), None if ids is None else [int(j) for j in ids]))
    return cases


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    mode = argv[0] if argv else None
    try:
        if mode == "load" and len(argv) in (2, 4) and (len(argv) == 2 or argv[2] == "--dtype"):
            report = load_report(argv[1], argv[3] if len(argv) == 4 else "float32")
        elif mode == "meta-load" and len(argv) == 3:
            report = meta_load_report(argv[1], argv[2])
        elif mode == "capture":
            report = capture_report(_parse_cases(argv[1:]))
        else:
            raise SystemExit(__doc__.split("\n\n")[1])
    except BaseException as e:  # SGLang refusing is the verdict, reported like any other
        traceback.print_exc()
        report = {"mode": mode, "ok": False, "problems": [f"SGLang replay failed: {type(e).__name__}: {e}"]}
    sys.stdout.flush()
    print(json.dumps(report, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
