"""SGLang's own code on our exports, run in SGLang's interpreter (.venv-sglang, CPU): the load-back and the
aux-layer capture that eagle3lib.convert.gate and eagle3lib.engines.sglang restate in pure Python.

    python eagle3lib/engines/engine_side/sglang_replay.py load EXPORT_DIR [--dtype float32]
    python eagle3lib/engines/engine_side/sglang_replay.py capture ARCH NUM_LAYERS IDS_JSON [ARCH NUM_LAYERS IDS_JSON ...]
    python eagle3lib/engines/engine_side/sglang_replay.py meta-load CONFIG_DIR SHAPES_JSON

Prints one JSON report line (last line of stdout). Standalone on purpose (stdlib, torch, safetensors and
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
    rope gets the factory's get_rope, as on a GPU: the CPU one asserts DeepSeek's YaRN (_plain_rope_on_cpu). Its
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
import tempfile
import traceback
from contextlib import contextmanager
from types import ModuleType
from types import SimpleNamespace as NS

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Multimodal wrappers whose set_eagle3_layers_to_capture delegates to self.language_model: the name of the class
# their __init__ builds it from (looked up in the wrapper's own module, so it is the class SGLang instantiates).
LANGUAGE_MODEL_CLASS = {"KimiK25ForConditionalGeneration": "DeepseekV3ForCausalLM"}
# Filled from the target at serve time (EAGLE worker's set_embed), never from the draft checkpoint.
SHARED_FROM_TARGET = ("model.embed_tokens.weight",)


# ---------------------------------------------------------------------------------------------- load ----


def _sglang_setup(export_dir, dtype):
    """Server args published, process group of one (gloo), and SGLang's ModelConfig of the draft."""
    import torch  # noqa: F401  (torch before sglang, as the server imports them)
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=export_dir, device="cpu", dtype=dtype, skip_tokenizer_init=True)
    publish(server_args, role="scheduler")  # the process that builds and loads models in a server
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        backend="gloo",
        distributed_init_method=f"file://{tempfile.mktemp(prefix='sglang-replay-')}",
    )
    ensure_model_parallel_initialized(1, 1, 1)
    return ModelConfig.from_server_args(server_args, model_path=export_dir, is_draft_model=True)


def _construct(model_config, load_config, device="cpu"):
    """(model, how, note): SGLang's _initialize_model on the CPU (or meta), as installed, else with the one kernel
    import that a CPU-only install lacks stubbed (see the module docstring)."""
    import torch
    from sglang.srt.model_loader.loader import _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    def build():
        with set_default_torch_dtype(model_config.dtype), torch.device(device), _plain_rope_on_cpu():
            return _initialize_model(model_config, load_config)

    try:
        return build(), "real model on cpu", None
    except ModuleNotFoundError as e:
        if e.name not in ("vllm", "vllm._custom_ops"):
            raise
        where = traceback.extract_tb(e.__traceback__)[-1]
        note = (
            f"SGLang's constructor as installed raised {type(e).__name__}: {e} at "
            f"{'/'.join(where.filename.split(os.sep)[-3:])}:{where.lineno} `{where.line}`: on a host that is "
            "neither CUDA nor SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1, which needs sgl_kernel's CPU build, "
            "absent here) RotaryEmbedding.__init__ binds vllm._custom_ops.rotary_embedding as its forward "
            "kernel. Built again with that one function stubbed (it would raise if called; loading never calls it)."
        )

    def rotary_embedding(*args, **kwargs):
        raise RuntimeError("sglang_replay: stub of vllm._custom_ops.rotary_embedding (forward is not replayed)")

    saved = {k: sys.modules.get(k) for k in ("vllm", "vllm._custom_ops")}
    ops = ModuleType("vllm._custom_ops")
    ops.rotary_embedding = rotary_embedding
    pkg = ModuleType("vllm")
    pkg._custom_ops = ops
    sys.modules.update({"vllm": pkg, "vllm._custom_ops": ops})
    try:
        model = build()
    finally:  # no other SGLang code may take the stub for an installed vLLM
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return model, "real model on cpu, vllm._custom_ops.rotary_embedding stubbed", note


@contextmanager
def _plain_rope_on_cpu():
    """SGLang's CPU rope for DeepSeek's attention (rotary_embedding/factory.py get_rope_cpu) asserts a DeepSeek-YaRN
    rope_scaling, so an MLA draft with a plain rope cannot be built with device cpu; such a rope has no weights, so
    it is built by the factory's get_rope (what a GPU server builds) and the loading replayed is SGLang's own."""
    from sglang.srt.layers.rotary_embedding import factory

    cpu_rope = factory.get_rope_cpu

    def rope(head_size, rotary_dim, max_position, base, is_neox_style=True, rope_scaling=None, *args, **kwargs):
        if rope_scaling is None:
            kwargs.pop("device", None)
            return factory.get_rope(head_size, rotary_dim, max_position, base, is_neox_style, None, *args[:2])
        return cpu_rope(head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, *args, **kwargs)

    factory.get_rope_cpu = rope
    try:
        yield
    finally:
        factory.get_rope_cpu = cpu_rope


def _bits(t):
    """The tensor viewed as integers of its element size: exact (NaN-safe) change detection."""
    import torch

    kind = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(kind)


def _rows(changed):
    """[start, stop) of the rows (dim 0) touched by a change mask, and whether they are exactly that block."""
    import torch

    per_row = changed if changed.dim() == 1 else changed.reshape(changed.shape[0], -1).any(1)
    idx = torch.nonzero(per_row).flatten()
    if idx.numel() == 0:
        return None, True
    start, stop = int(idx[0]), int(idx[-1]) + 1
    return [start, stop], idx.numel() == stop - start


def load_report(export_dir, dtype="float32"):
    import sglang
    import torch
    from safetensors.torch import load_file
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader

    problems = []
    ours = load_file(os.path.join(export_dir, "model.safetensors"))
    model_config = _sglang_setup(export_dir, dtype)
    load_config = LoadConfig(model_loader_extra_config={"enable_multithread_load": False})
    model, how, note = _construct(model_config, load_config)
    params = dict(model.named_parameters())

    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))
    prev = {n: _bits(p).clone() for n, p in params.items()}
    written = {n: torch.zeros(p.shape[0] if p.dim() else 1, dtype=torch.bool) for n, p in params.items()}

    # The shard id SGLang hands each parameter's weight_loader (its own bound method, wrapped to record the call).
    calls = []
    current = {"name": None}
    for n, p in params.items():
        loader = p.__dict__.get("weight_loader")
        if loader is None:
            continue

        def record(param, loaded_weight, *args, _n=n, _loader=loader, **kwargs):
            shard = args[0] if args else kwargs.get("loaded_shard_id", kwargs.get("shard_id"))
            calls.append((current["name"], _n, shard))
            return _loader(param, loaded_weight, *args, **kwargs)

        p.weight_loader = record

    per_tensor, read = {}, []

    def instrumented(weights):
        """SGLang's weights iterator; after load_weights has taken each tensor, what it changed."""
        for name, tensor in weights:
            current["name"] = name
            read.append(name)
            hot_before = getattr(model, "hot_token_id", None)
            yield name, tensor
            wrote = []
            for n, p in params.items():
                now = _bits(p)
                changed = now != prev[n]
                if not changed.any():
                    continue
                rows, block = _rows(changed) if p.dim() else ([0, 1], True)
                shard = next((s for t, q, s in calls if t == name and q == n), None)
                wrote.append({"param": n, "rows": rows, "contiguous": block, "shard": shard})
                written[n][rows[0] : rows[1]] = True
                prev[n] = now.clone()
            hot = getattr(model, "hot_token_id", None)
            per_tensor[name] = {"wrote": wrote, "hot_token_id": hot is not None and hot is not hot_before}

    DefaultModelLoader.load_weights_and_postprocess(
        model, instrumented(DefaultModelLoader(load_config)._get_all_weights(model_config, model)), torch.device("cpu")
    )
    _attribute_deferred_fusions(params, per_tensor, ours)

    report_params = {}
    for n, p in params.items():
        bound = []
        for t, info in per_tensor.items():
            for w in info["wrote"]:
                if w["param"] != n:
                    continue
                a, b = w["rows"]
                src = ours.get(t)
                got = p.detach()[a:b] if p.dim() else p.detach().reshape(1)
                equal = (
                    src is not None
                    and w["contiguous"]
                    and tuple(got.shape) == tuple(src.shape)
                    and torch.equal(got, src.to(got.dtype))
                )
                bound.append({"tensor": t, "shard": w["shard"], "rows": [a, b], "equal": bool(equal)})
                if not equal:
                    problems.append(
                        f"{n} rows {a}:{b} (shard {w['shard']}) hold {t} "
                        f"{tuple(src.shape) if src is not None else '(not in the file)'} but not its values "
                        "(wrong slice, shape, or overwritten)."
                    )
        fully = bool(written[n].all())
        report_params[n] = {"shape": list(p.shape), "bound_from": bound, "fully_bound": fully}
        if not fully and n not in SHARED_FROM_TARGET:
            what = "gets no tensor" if not bound else f"gets only rows {[b['rows'] for b in bound]}"
            problems.append(f"SGLang parameter {n} {tuple(p.shape)} {what} from the export (stays at its random init).")
        owners = [b["tensor"] for b in bound]
        if len(set(owners)) != len(owners) or _overlap([b["rows"] for b in bound]):
            problems.append(f"{n} is written by overlapping tensors {owners}.")

    tensors = {}
    for t in ours:
        info = per_tensor.get(t, {"wrote": [], "hot_token_id": False})
        keys = [w["param"] + (f"[{w['shard']}]" if w["shard"] is not None else "") for w in info["wrote"]]
        if info["hot_token_id"]:
            keys.append("hot_token_id")
        tensors[t] = keys
    not_read = sorted(set(ours) - set(read))
    dropped = sorted(t for t, keys in tensors.items() if not keys)
    for t in dropped:
        if "t2d" not in t:
            problems.append(
                f"tensor {t} {tuple(ours[t].shape)} is dropped by SGLang {sglang.__version__}'s load_weights"
                + (" (its weights iterator never yields it)." if t in not_read else " (no parameter takes it).")
            )

    hot = getattr(model, "hot_token_id", None)
    d2t = ours.get("d2t")
    hot_ok = hot is not None and d2t is not None and torch.equal(hot, d2t + torch.arange(d2t.shape[0]))
    hot_info = {"shape": list(hot.shape) if hot is not None else None}
    if hot is None:
        problems.append("hot_token_id is None after loading: SGLang will map draft ids to target ids as identity.")
    elif not hot_ok:
        problems.append("hot_token_id is not d2t + arange: the draft-to-target map SGLang uses is not ours.")
    if hot is not None:
        t2d = ours.get("t2d")
        in_range = bool(((hot >= 0) & (hot < model.config.vocab_size)).all())
        hot_info["in_target_vocab"] = in_range
        if t2d is not None and in_range:
            hot_info["matches_t2d"] = bool(t2d[hot].all()) and int(t2d.sum()) == hot.shape[0]
            if not hot_info["matches_t2d"]:
                problems.append("hot_token_id (from d2t) and t2d name different target tokens.")
        if not in_range:
            problems.append("hot_token_id holds ids outside the target vocabulary.")

    # Serve time: EAGLE worker shares the target's embedding (set_embed) unless the hidden sizes differ.
    shared = _replay_set_embed(model)
    if not shared:
        problems.append(
            "SGLang's set_embed would not share the target's embed_tokens (target_hidden_size != hidden_size): "
            "the draft embedding stays at its random init."
        )
    return {
        "mode": "load",
        "ok": not problems,
        "problems": problems,
        "how": how,
        "construct_note": note,
        "sglang_version": sglang.__version__,
        "model_class": type(model).__name__,
        "dtype": str(model_config.dtype),
        "params": report_params,
        "tensors": tensors,
        "dropped": dropped,
        "not_read": not_read,
        "hot_token_id_ok": bool(hot_ok),
        "hot_token_id": hot_info,
        "load_lm_head_from_target": bool(getattr(model, "load_lm_head_from_target", False)),
        "embed_shared_from_target": shared,
    }


def _attribute_deferred_fusions(params, per_tensor, ours):
    """A loader that holds a tensor back and writes it later fused with another (kimi_k25_eagle3's load_weights
    caches q_a_proj / kv_a_proj_with_mqa until both came, then loads their concatenation into
    fused_qkv_a_proj_with_mqa) shows as the second tensor writing both row blocks and the first writing nothing.
    Split such a write between the two when the rows are exactly their concatenation, in either order."""
    import torch

    silent = [t for t, info in per_tensor.items() if not info["wrote"] and t in ours]
    for name, info in per_tensor.items():
        src = ours.get(name)
        for w in list(info["wrote"]):
            p = params[w["param"]]
            a, b = w["rows"]
            got = p.detach()[a:b]
            if src is None or (tuple(got.shape) == tuple(src.shape) and torch.equal(got, src.to(got.dtype))):
                continue
            for other in silent:
                o = ours[other]
                if o.shape[1:] != src.shape[1:] or o.shape[0] + src.shape[0] != b - a:
                    continue
                for first, second in ((other, name), (name, other)):
                    if torch.equal(got, torch.cat([ours[first], ours[second]]).to(got.dtype)):
                        cut = a + ours[first].shape[0]
                        split = {first: [a, cut], second: [cut, b]}
                        info["wrote"].remove(w)
                        for t in (first, second):
                            per_tensor[t]["wrote"].append({**w, "rows": split[t], "fused_with": [first, second]})
                        silent.remove(other)
                        break
                else:
                    continue
                break


def meta_load_report(config_dir, shapes_json, dtype="bfloat16"):
    import sglang
    import torch
    from sglang.srt.configs.load_config import LoadConfig

    with open(shapes_json) as f:
        shapes = json.load(f)
    model_config = _sglang_setup(config_dir, dtype)
    # SGLang's registry imports its model modules on first lookup; some make tensors at import, which must not be
    # on the meta device: look the class up first, then build it there.
    from sglang.srt.model_loader.utils import get_model_architecture

    get_model_architecture(model_config)
    model, how, _ = _construct(model_config, LoadConfig(), device="meta")
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    params = dict(model.named_parameters())
    calls, current = [], {"name": None}
    for n, p in params.items():
        # a parameter without its own loader gets default_weight_loader (load_weights' getattr default)
        loader = p.__dict__.get("weight_loader", default_weight_loader)

        def record(param, loaded_weight, *args, _n=n, _loader=loader, **kwargs):
            shard = args[0] if args else kwargs.get("loaded_shard_id", kwargs.get("shard_id"))
            calls.append((current["name"], _n, shard))
            return _loader(param, loaded_weight, *args, **kwargs)

        p.weight_loader = record

    def weights():
        for name, shape in shapes.items():
            current["name"] = name
            small = name.endswith(("d2t", "t2d"))  # read by value (hot_token_id = d2t + arange)
            dtype_ = {"d2t": torch.int64, "t2d": torch.bool}.get(name.rsplit(".", 1)[-1], model_config.dtype)
            yield name, torch.zeros(shape, dtype=dtype_) if small else torch.empty(shape, dtype=dtype_, device="meta")

    problems = []
    try:
        model.load_weights(weights())
    except Exception as e:  # a shape a weight loader refuses: the verdict
        problems.append(f"SGLang's load_weights refused the tensor {current['name']}: {type(e).__name__}: {e}")
    loaded_into = {t: [] for t in shapes}
    for t, n, shard in calls:
        loaded_into.setdefault(t, []).append(n + (f"[{shard}]" if shard is not None else ""))
    if "d2t" in shapes and getattr(model, "hot_token_id", None) is not None:
        loaded_into["d2t"].append("hot_token_id")
    # a fused write comes with the second tensor of the pair: the first (held back, no call of its own) went there
    fused = {t for t, n, _ in calls if "fused_qkv_a_proj_with_mqa" in n}
    for t in shapes:
        partner = t.replace("kv_a_proj_with_mqa", "q_a_proj") if "kv_a_proj_with_mqa" in t else None
        partner = partner or (t.replace("q_a_proj", "kv_a_proj_with_mqa") if "q_a_proj" in t else None)
        if not loaded_into[t] and partner in fused:
            loaded_into[t] = [n for tt, n, _ in calls if tt == partner]
    reached = {n.split("[")[0] for names in loaded_into.values() for n in names}
    unloaded = sorted(n for n in params if n not in reached and n not in SHARED_FROM_TARGET)
    dropped = sorted(t for t, names in loaded_into.items() if not names and "t2d" not in t)
    problems += [f"SGLang parameter {n} {tuple(params[n].shape)} gets no tensor." for n in unloaded]
    problems += [f"tensor {t} {tuple(shapes[t])} is dropped by SGLang's load_weights." for t in dropped]
    return {
        "mode": "meta-load",
        "how": how.replace("on cpu", "on the meta device"),
        "ok": not problems,
        "problems": problems,
        "sglang_version": sglang.__version__,
        "model_class": type(model).__name__,
        "params": {n: list(p.shape) for n, p in params.items()},
        "loaded_into": loaded_into,
        "unloaded": unloaded,
        "dropped": dropped,
    }


def _overlap(ranges):
    spans = sorted(r for r in ranges if r)
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


def _replay_set_embed(model):
    """Whether SGLang's own set_embed (EAGLE worker's init_lm_head) replaces embed_tokens with the target's."""
    import torch

    if getattr(model, "load_lm_head_from_target", False) or not hasattr(model, "set_embed"):
        return hasattr(model, "set_embed_and_head")
    old = model.model.embed_tokens.weight
    stand_in = torch.nn.Parameter(torch.zeros(1, dtype=old.dtype), requires_grad=False)
    # Eagle3DeepseekV2ForCausalLM.set_embed ends with torch.cuda.empty_cache() and synchronize(), which raise on a
    # host without CUDA; they only free and wait on the GPU, so on the CPU they are no-ops for the replay.
    saved = torch.cuda.empty_cache, torch.cuda.synchronize
    if not torch.cuda.is_available():
        torch.cuda.empty_cache = torch.cuda.synchronize = lambda *args, **kwargs: None
    try:
        model.set_embed(stand_in)
    finally:
        torch.cuda.empty_cache, torch.cuda.synchronize = saved
    return model.model.embed_tokens.weight is stand_in


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
