"""Engine-side load-back checks, run in the engine's own interpreter (.venv-vllm / .venv-sglang).

    python eagle3lib/engines/engine_side/load_check.py vllm DRAFT_DIR --target TARGET_DIR [--depth D]
    python eagle3lib/engines/engine_side/load_check.py sglang --args '[...launch flags...]'
    python eagle3lib/engines/engine_side/load_check.py vllm-forward DRAFT_DIR --target TARGET_DIR --inputs IN --out OUT
    python eagle3lib/engines/engine_side/load_check.py vllm-meta CONFIG_DIR --target TARGET_DIR --shapes SHAPES_JSON

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


# The parameters vLLM's draft models fuse from several checkpoint tensors, in the order of their shards:
# llama_eagle3.py's qkv_proj and gate_up_proj, deepseek_eagle3.py's fused_qkv_a_proj (MLA, with q_lora_rank).
FUSED = (
    ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attn.fused_qkv_a_proj", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")),
    ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
)


def _expected_vllm_params(ours):
    """{vLLM parameter name: [our tensor names whose concatenation it must hold]}: every tensor of the checkpoint
    under model. (lm_head at the top, d2t as draft_id_to_target_id, t2d dropped by design), the FUSED groups as one
    parameter each. GQA (Eagle3LlamaForCausalLM) and MLA (Eagle3DeepseekV2ForCausalLM) layers alike."""
    want, fused = {}, set()
    for param, parts in FUSED:
        sources = [f"layers.0.{part}.weight" for part in parts]
        if all(n in ours for n in sources):
            want[f"model.layers.0.{param}.weight"] = sources
            fused.update(sources)
    for name in ours:
        if name in fused or name == "t2d":
            continue
        if name == "d2t":  # present only for a draft vocabulary smaller than the target's
            want["draft_id_to_target_id"] = ["d2t"]
        elif name.startswith("lm_head."):
            want[name] = [name]
        else:
            want["model." + name] = [name]
    return want


def _vllm_config(draft, target, depth):
    """The VllmConfig `vllm serve TARGET --speculative-config {eagle3 DRAFT}` builds, and the draft's model config."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=target,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        # as engines/vllm.py serves it (speculative_config): the argmax over the draft vocabulary
        speculative_config={
            "method": "eagle3",
            "model": draft,
            "num_speculative_tokens": depth,
            "use_local_argmax_reduction": True,
        },
        # MLA on a CPU with AMX would get AMX_MLA, which packs its weights for bf16 only and refuses fp32 ("expect
        # weight to be bfloat16, ..."); vLLM's reference CPU MLA takes fp32. Other attention ignores it.
        attention_backend="CPU_MLA",
    )
    vllm_config = args.create_engine_config()
    return vllm_config, vllm_config.speculative_config.draft_model_config


def one_process_group(prefix: str) -> None:
    """vLLM's distributed state for one process on the CPU (gloo), as its loaders need it."""
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo",
        distributed_init_method=f"file://{tempfile.mktemp(prefix=prefix)}",
    )  # fmt: skip
    ensure_model_parallel_initialized(1, 1)


def _vllm_draft(draft, target, depth):
    """(vllm_config, the draft's model config, its model loaded by vLLM's own loader, problems, skipped)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    problems = []
    vllm_config, draft_cfg = _vllm_config(draft, target, depth)
    with set_current_vllm_config(vllm_config):
        one_process_group("vllm-gate-")
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


def meta_vllm(draft, target, shapes_json):
    """vLLM's draft model on the meta device, loaded by its own load_weights from meta tensors of the given shapes."""
    import torch
    import vllm
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.utils.torch_utils import set_default_torch_dtype

    with open(shapes_json) as f:
        shapes = json.load(f)
    vllm_config, draft_cfg = _vllm_config(draft, target, 1)
    problems = []
    with set_current_vllm_config(vllm_config):
        one_process_group("vllm-meta-")
        get_model_architecture(draft_cfg)  # imports the model's module off the meta device (it may make tensors)
        loader = get_model_loader(vllm_config.load_config)
        with set_default_torch_dtype(draft_cfg.dtype), torch.device("meta"):
            model = loader.create_model(vllm_config=vllm_config, model_config=draft_cfg)
        params = dict(model.named_parameters())
        seen = set()

        def weights():
            for name, shape in shapes.items():
                seen.add(name)
                kind = {"d2t": torch.int64, "t2d": torch.bool}.get(name, draft_cfg.dtype)
                yield name, torch.empty(shape, dtype=kind, device="meta")

        try:
            model.load_weights(weights())
        except Exception as e:  # a name vLLM cannot place or a shape a loader refuses: the verdict
            problems.append(f"vLLM's load_weights refused the checkpoint: {type(e).__name__}: {e}")
    want = _expected_vllm_params(shapes)
    for name, sources in want.items():
        if name not in params:
            problems.append(f"vLLM's {type(model).__name__} has no parameter {name} for our tensor(s) {sources}.")
            continue
        rows = sum(shapes[n][0] for n in sources)
        if [rows, *shapes[sources[0]][1:]] != list(params[name].shape):
            problems.append(f"{name}: vLLM holds shape {tuple(params[name].shape)}, ours {sources} make {rows} rows.")
    extra = sorted(n for n in params if n not in want and "embed_tokens" not in n)
    problems += [f"vLLM parameter {n} {tuple(params[n].shape)} has no tensor in the export." for n in extra]
    return {
        "engine": "vllm",
        "mode": "meta",
        "ok": not problems,
        "problems": problems,
        "vllm_version": vllm.__version__,
        "model_class": type(model).__name__,
        "params": {n: list(p.shape) for n, p in params.items()},
        "read": sorted(seen),
    }


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
    if not hasattr(model, "get_top_tokens"):  # vLLM's proposer refuses the served config at start without it
        problems.append(
            f"vLLM's {type(model).__name__} has no get_top_tokens, which the served use_local_argmax_reduction needs "
            "(engines/vllm.py speculative_config): this vLLM's drafter class for "
            f"{list(draft_cfg.hf_config.architectures or [])} lacks LocalArgmaxMixin; serve without the flag."
        )
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


def _plain_mla_attention(mla):
    """A stand-in for vLLM's MLAAttention.forward over one sequence: q [T, heads, qk_nope + qk_rope] after the rotary,
    the normed latent kv_c [T, kv_lora_rank] and the rotated shared key k_pe [T, 1, qk_rope]. k_nope and v come from
    the kv_b_proj vLLM loaded, then causal softmax with its scale (YaRN's mscale² in it). vLLM's kernels absorb
    kv_b_proj into q and the output to attend over the latent cache, the same scores; they need the engine's batch
    metadata. What is compared is the model around them (the fused q/latent projection of the 2H input, the q and
    latent norms, q_b_proj, the latent split, the interleaved YaRN rotary, kv_b_proj's per-head layout, o_proj)."""
    import torch
    import torch.nn.functional as F

    heads, nope, v_dim = mla.num_heads, mla.qk_nope_head_dim, mla.v_head_dim

    def forward(q, kv_c_normed, k_pe, output_shape=None, **kwargs):
        t = q.shape[0]
        k_nope, v = mla.kv_b_proj(kv_c_normed)[0].view(t, heads, nope + v_dim).split([nope, v_dim], -1)
        k = torch.cat([k_nope, k_pe.expand(t, heads, k_pe.shape[-1])], -1)
        by_head = lambda x: x.transpose(0, 1)[None]  # noqa: E731
        out = F.scaled_dot_product_attention(by_head(q), by_head(k), by_head(v), is_causal=True, scale=mla.scale)
        return out[0].transpose(0, 1).reshape(t, heads * v_dim).to(q.dtype)

    return forward


def forward_vllm(draft, target, inputs, out):
    """vLLM's Eagle3LlamaForCausalLM (or, for an MLA draft, Eagle3DeepseekV2ForCausalLM) forward on one sequence: inputs (safetensors) holds input_embeds [T, H] (the
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
        if hasattr(layer.self_attn, "mla_attn"):  # DeepseekV2MLAAttention: the MLAAttention inside its wrapper
            inner = layer.self_attn.mla_attn.mla_attn
            inner.forward = _plain_mla_attention(inner)
        else:
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
