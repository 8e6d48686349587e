"""Engine-side load-back checks, run in the engine's own interpreter (.venv-vllm / .venv-sglang).

    python eagle3lib/engines/inside/load_check.py vllm DRAFT_DIR --target TARGET_DIR [--depth D]
    python eagle3lib/engines/inside/load_check.py sglang --args '[...launch flags...]'
    python eagle3lib/engines/inside/load_check.py vllm-forward DRAFT_DIR --target TARGET_DIR --inputs IN --out OUT

Prints one JSON report line. Standalone on purpose (stdlib, torch, safetensors and the engine only):
the engines pin transformers versions that our .venv does not have, so eagle3lib.engines.interpreter runs this
file through a subprocess and never imports an engine itself.

vllm: builds the VllmConfig that `vllm serve TARGET --speculative-config {...}` would build, loads the
    draft with vLLM's own model loader (get_model -> Eagle3LlamaForCausalLM.load_weights) on the CPU,
    and compares every parameter with the checkpoint's tensors (q/k/v and gate/up fused as vLLM does).
    AutoWeightsLoader raises on a name it cannot place; a parameter left unloaded shows as a mismatch.
sglang: resolves the launch flags with SGLang's own prepare_server_args (ServerArgs.__post_init__) and, for
    an EAGLE3 launch, reads the aux ids SGLang will hand to the target's set_eagle3_layers_to_capture. The
    deploy, convert and extraction checks all use it; add `--device cpu` to run it without a GPU.
vllm-forward: the draft's forward in vLLM's own Eagle3LlamaForCausalLM on given inputs (attention over the one
    sequence by plain causal softmax in place of the engine's kernels), to compare with our Drafter.step.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _load_ours(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def _written_flags(folder):
    """The EAGLE-3.1 flags config.json states explicitly (flat), as a reader that assumes no default sees them."""
    import json

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    return {
        k: bool(v)
        for k, v in config.items()
        if k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
    }


def _expected_vllm_params(ours):
    """{vLLM parameter name: [our tensor names whose concatenation it must hold]} (q/k/v and gate/up fused)."""
    p, a, m = "model.layers.0.", "layers.0.self_attn.", "layers.0.mlp."
    want = {
        "model.fc.weight": ["fc.weight"],
        p + "self_attn.qkv_proj.weight": [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
        p + "self_attn.o_proj.weight": [a + "o_proj.weight"],
        p + "mlp.gate_up_proj.weight": [m + "gate_proj.weight", m + "up_proj.weight"],
        p + "mlp.down_proj.weight": [m + "down_proj.weight"],
        "model.norm.weight": ["norm.weight"],
        "lm_head.weight": ["lm_head.weight"],
    }
    if "d2t" in ours:  # a full-vocabulary draft has no map, and vLLM no parameter for one
        want["draft_id_to_target_id"] = ["d2t"]
    if "input_norm.weight" in ours:  # EAGLE-3.1 norm_before_fc
        want["model.input_norm.weight"] = ["input_norm.weight"]
    for name in (n for n in ours if n.startswith("fc_norm.")):  # EAGLE-3.1 fc_norm
        want["model." + name] = [name]
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        want[p + n + ".weight"] = [f"layers.0.{n}.weight"]
    return want


def _vllm_draft(draft, target, depth):
    """(vllm_config, the draft's model config, its model loaded by vLLM's own loader, problems, skipped)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    problems = []
    args = EngineArgs(
        model=target,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": depth},
    )
    vllm_config = args.create_engine_config()
    draft_cfg = vllm_config.speculative_config.draft_model_config
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"file://{tempfile.mktemp(prefix='vllm-gate-')}",
        )
        ensure_model_parallel_initialized(1, 1)
        # DefaultModelLoader.load_model's own steps (create_model, load_weights) without its
        # torch.accelerator.empty_cache(), which raises on a machine with no accelerator.
        loader = get_model_loader(vllm_config.load_config)
        with set_default_torch_dtype(draft_cfg.dtype), torch.device("cpu"):
            model = loader.create_model(vllm_config=vllm_config, model_config=draft_cfg)
        try:
            loader.load_weights(model, draft_cfg)
        except (ValueError, KeyError, AssertionError, RuntimeError) as e:
            # AutoWeightsLoader refuses a tensor name it cannot place; a shape mismatch asserts.
            import traceback

            where = traceback.extract_tb(e.__traceback__)[-1]
            problems.append(
                f"vLLM's loader rejected the checkpoint: {type(e).__name__}: {str(e) or '(no message)'} at "
                f"{Path(where.filename).name}:{where.lineno} `{where.line}` (a tensor name vLLM cannot "
                "place, or a shape that does not fit its parameter; see the per-parameter lines)."
            )
            skipped = 1
        else:
            skipped = 0
    return vllm_config, draft_cfg, model, problems, skipped


def check_vllm(draft, target, depth):
    import torch
    import vllm
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    vllm_config, draft_cfg, model, problems, skipped = _vllm_draft(draft, target, depth)
    spec = vllm_config.speculative_config
    # The aux layers the target will capture: the model runner's own lookup (vLLM id = HF hidden_states index).
    captured = GPUModelRunner._get_eagle3_aux_layers_from_config(type("R", (), {"speculative_config": spec})())
    try:
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

        captured_v2 = get_eagle3_aux_layers_from_config(spec)
    except ImportError:
        captured_v2 = captured
    if captured_v2 != captured:
        problems.append(
            f"vLLM's two model runners disagree on the aux layers: {captured} vs {captured_v2}; "
            "write eagle_aux_hidden_state_layer_ids at the top level of config.json."
        )

    hf = draft_cfg.hf_config
    written = _written_flags(draft)
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        if bool(getattr(hf, flag, False)) != written.get(flag, False):
            problems.append(
                f"vLLM reads {flag}={bool(getattr(hf, flag, False))} from the draft config, which says "
                f"{written.get(flag, '(absent)')}: write every EAGLE-3.1 flag explicitly "
                "(speculators and vLLM take an absent norm_before_residual as true)."
            )
    ours = _load_ours(draft)
    want = _expected_vllm_params(ours)
    params = dict(model.named_parameters())
    loaded, mismatched = [], []
    for name, sources in want.items():
        absent = [n for n in sources if n not in ours]
        if absent:
            problems.append(f"the checkpoint has no {absent} for vLLM's {name}.")
            continue
        tensor = torch.cat([ours[n] for n in sources])
        if name not in params:
            problems.append(f"vLLM's {type(model).__name__} has no parameter {name} for our tensor(s).")
            continue
        got = params[name].detach().cpu()
        if tuple(got.shape) != tuple(tensor.shape):
            problems.append(f"{name}: vLLM holds shape {tuple(got.shape)}, ours is {tuple(tensor.shape)}.")
        elif not torch.equal(got.to(torch.float64), tensor.to(torch.float64)):
            mismatched.append(name)
            problems.append(
                f"{name}: vLLM loaded different values than the checkpoint holds (not loaded, or loaded "
                "into the wrong slice)."
            )
        else:
            loaded.append(name)
    # embed_tokens is the target's (shared at load time when the draft has none): not ours to fill.
    extra = sorted(n for n in params if n not in want and "embed_tokens" not in n)
    for n in extra:
        problems.append(f"vLLM parameter {n} {tuple(params[n].shape)} has no tensor in our checkpoint (random init).")
    return {
        "engine": "vllm",
        "ok": not problems,
        "problems": problems,
        "vllm_version": vllm.__version__,
        "model_class": type(model).__name__,
        "architectures": list(draft_cfg.hf_config.architectures or []),
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "captured_hf_layers": list(captured) if captured else None,
        "counts": {
            "expected": len(want),
            "loaded": len(loaded),
            "skipped": skipped,
            "missing": len(want) - len(loaded),
            "extra": len(extra),
        },
        "draft_params": {n: list(p.shape) for n, p in params.items()},
    }


def _plain_causal_attention(attn):
    """A stand-in for vLLM's Attention.forward over one sequence (q, k, v after its rotary embedding, [T, heads *
    head_dim]): causal softmax attention with its scale and GQA. The kernels need the engine's batch metadata;
    what is compared is the model around them (fc, norms, the embeds/hidden order, q/k/v split, rotary, MLP)."""
    import torch.nn.functional as F

    heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_size

    def forward(query, key, value, *args, **kwargs):
        t = query.shape[0]
        q = query.view(t, heads, head_dim).transpose(0, 1)
        k = key.view(t, kv_heads, head_dim).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        v = value.view(t, kv_heads, head_dim).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=attn.impl.scale)
        return out[0].transpose(0, 1).reshape(t, heads * head_dim).to(query.dtype)

    return forward


def forward_vllm(draft, target, inputs, out):
    """vLLM's Eagle3LlamaForCausalLM forward on one sequence: inputs (safetensors) holds input_embeds [T, H] (the
    target's embeddings of the tokens fed), aux [T, 3 H_t] and positions [T]; out gets its logits over the target
    vocabulary (compute_logits: draft rows mapped through d2t, -inf elsewhere) and the pre-norm hidden state."""
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    vllm_config, draft_cfg, model, problems, _ = _vllm_draft(draft, target, 1)
    if problems:
        return {"engine": "vllm", "ok": False, "problems": problems}
    with set_current_vllm_config(vllm_config):  # as the loader finishes a load: the CPU linear kernels' set-up
        process_weights_after_loading(model, draft_cfg, torch.device("cpu"))
    x = load_file(inputs)
    for layer in model.model.layers:
        layer.self_attn.attn.forward = _plain_causal_attention(layer.self_attn.attn)
    with torch.inference_mode(), set_current_vllm_config(vllm_config), set_forward_context(None, vllm_config):
        hidden = model.combine_hidden_states(x["aux"])
        positions = x["positions"].long()
        ids = torch.zeros_like(positions)  # unused: the embeddings are given
        normed, prenorm = model(ids, positions, hidden, x["input_embeds"])
        logits = model.compute_logits(normed)
    save_file({"logits": logits.float().contiguous(), "prenorm": prenorm.float().contiguous()}, out)
    return {"engine": "vllm", "ok": True, "problems": [], "model_class": type(model).__name__, "out": out}


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", choices=["vllm", "sglang", "vllm-forward"])
    ap.add_argument("draft", nargs="?", help="vllm: the export folder (sglang: the flags name it)")
    ap.add_argument("--target")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--args", help="JSON list of SGLang launch flags")
    ap.add_argument("--inputs", help="vllm-forward: safetensors with input_embeds, aux, positions")
    ap.add_argument("--out", help="vllm-forward: where its logits and pre-norm hidden state go")
    a = ap.parse_args(argv)
    try:
        if a.engine == "vllm":
            report = check_vllm(a.draft, a.target, a.depth)
        elif a.engine == "vllm-forward":
            report = forward_vllm(a.draft, a.target, a.inputs, a.out)
        else:
            report = check_sglang(json.loads(a.args))
    except BaseException as e:  # the engine refusing (argparse's SystemExit included) is the verdict, not a crash
        import traceback

        traceback.print_exc()
        verdict = "SGLang refused the flags" if a.engine == "sglang" else "vllm could not build or load the draft"
        report = {
            "engine": a.engine,
            "ok": False,
            "captured_hf_layers": None,
            "problems": [f"{verdict}: {type(e).__name__}: {e}"],
            "resolved": {},
            "counts": {"expected": 0, "loaded": 0, "skipped": 0, "missing": 0, "extra": 0},
        }
    sys.stdout.flush()
    print(json.dumps(report, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
