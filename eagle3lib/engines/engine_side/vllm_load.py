"""vLLM's own loader on our export, in vLLM's interpreter (load_check.py's vllm and vllm-meta): the VllmConfig
`vllm serve TARGET --speculative-config {eagle3 DRAFT}` builds, the draft loaded by vLLM's loader, and every
parameter compared with the checkpoint's tensors. Standalone (stdlib, torch, safetensors and vLLM only)."""

import json
import os
import tempfile
from pathlib import Path


def load_ours(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def written_flags(folder):
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


def expected_vllm_params(ours):
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


def vllm_config_for(draft, target, depth):
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


def vllm_draft(draft, target, depth):
    """(vllm_config, the draft's model config, its model loaded by vLLM's own loader, problems, skipped)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    problems = []
    vllm_config, draft_cfg = vllm_config_for(draft, target, depth)
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
    vllm_config, draft_cfg = vllm_config_for(draft, target, 1)
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
    want = expected_vllm_params(shapes)
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


def captured_aux_layers(spec, problems: list) -> list | None:
    """The aux layers the target will capture: the model runner's own lookup (vLLM id = HF hidden_states index);
    a problem where vLLM's two model runners disagree."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

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
    return captured


def flag_problems(hf, draft) -> list[str]:
    """The EAGLE-3.1 flags vLLM reads from the draft's config (hf) other than config.json states them."""
    written = written_flags(draft)
    return [
        f"vLLM reads {flag}={bool(getattr(hf, flag, False))} from the draft config, which says "
        f"{written.get(flag, '(absent)')}: write every EAGLE-3.1 flag explicitly "
        "(speculators and vLLM take an absent norm_before_residual as true)."
        for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
        if bool(getattr(hf, flag, False)) != written.get(flag, False)
    ]


def check_vllm(draft, target, depth):
    import torch
    import vllm

    vllm_config, draft_cfg, model, problems, skipped = vllm_draft(draft, target, depth)
    spec = vllm_config.speculative_config
    captured = captured_aux_layers(spec, problems)
    problems += flag_problems(draft_cfg.hf_config, draft)
    ours = load_ours(draft)
    want = expected_vllm_params(ours)
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
