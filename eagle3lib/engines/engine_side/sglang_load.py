"""sglang_replay.py's load: SGLang's own model class and loader on our export, every parameter traced to the
tensors that wrote it, hot_token_id and the shared embedding checked. Standalone (stdlib, torch, safetensors and
SGLang only)."""

import os

from sglang_model import construct, record_weight_loaders, sglang_setup

# Filled from the target at serve time (EAGLE worker's set_embed), never from the draft checkpoint.
SHARED_FROM_TARGET = ("model.embed_tokens.weight",)


def load_report(export_dir, dtype="float32"):
    """SGLang's own model and loader on the export in export_dir, each parameter's rows traced to the tensors that
    wrote them (see sglang_replay.py's load)."""
    import sglang
    from safetensors.torch import load_file
    from sglang.srt.configs.load_config import LoadConfig

    problems = []
    ours = load_file(os.path.join(export_dir, "model.safetensors"))
    model_config = sglang_setup(export_dir, dtype)
    load_config = LoadConfig(model_loader_extra_config={"enable_multithread_load": False})
    model, how, note = construct(model_config, load_config)
    params = dict(model.named_parameters())
    per_tensor, read, written = traced_load(model, model_config, load_config, params)
    attribute_deferred_fusions(params, per_tensor, ours)
    report_params = bound_params(params, per_tensor, ours, written, problems)
    tensors, dropped, not_read = tensor_fates(ours, per_tensor, read, problems)
    hot_ok, hot_info = hot_token_check(model, ours, problems)
    # Serve time: EAGLE worker shares the target's embedding (set_embed) unless the hidden sizes differ.
    shared = replay_set_embed(model)
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


def traced_load(model, model_config, load_config, params):
    """SGLang's own load (DefaultModelLoader's weights iterator into load_weights_and_postprocess), every parameter
    NaN first: (per tensor: the rows of each parameter it changed and the shard it was loaded as, and whether it set
    hot_token_id; the tensors read, in order; per parameter: which rows were written)."""
    import torch
    from sglang.srt.model_loader.loader import DefaultModelLoader

    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))
    prev = {n: bits(p).clone() for n, p in params.items()}
    written = {n: torch.zeros(p.shape[0] if p.dim() else 1, dtype=torch.bool) for n, p in params.items()}

    # The shard id SGLang hands each parameter's weight_loader (its own bound method, wrapped to record the call).
    calls = []
    current = {"name": None}
    record_weight_loaders(params, calls, current)

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
                now = bits(p)
                changed = now != prev[n]
                if not changed.any():
                    continue
                rows, block = changed_rows(changed) if p.dim() else ([0, 1], True)
                shard = next((s for t, q, s in calls if t == name and q == n), None)
                wrote.append({"param": n, "rows": rows, "contiguous": block, "shard": shard})
                written[n][rows[0] : rows[1]] = True
                prev[n] = now.clone()
            hot = getattr(model, "hot_token_id", None)
            per_tensor[name] = {"wrote": wrote, "hot_token_id": hot is not None and hot is not hot_before}

    DefaultModelLoader.load_weights_and_postprocess(
        model, instrumented(DefaultModelLoader(load_config)._get_all_weights(model_config, model)), torch.device("cpu")
    )
    return per_tensor, read, written


def bound_params(params, per_tensor, ours, written, problems: list) -> dict:
    """{parameter: its shape, the tensors bound to it (rows, shard, equal to the file's) and whether every row was
    written}; a problem for each row block that holds other values, each parameter left unwritten and each written
    by overlapping tensors."""
    import torch

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
        if len(set(owners)) != len(owners) or overlap([b["rows"] for b in bound]):
            problems.append(f"{n} is written by overlapping tensors {owners}.")
    return report_params


def tensor_fates(ours, per_tensor, read, problems: list) -> tuple[dict, list, list]:
    """({tensor: the parameters[shard] it went to}, the tensors no parameter took, those never read); a problem for
    each dropped tensor but t2d."""
    from sglang import __version__ as version

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
                f"tensor {t} {tuple(ours[t].shape)} is dropped by SGLang {version}'s load_weights"
                + (" (its weights iterator never yields it)." if t in not_read else " (no parameter takes it).")
            )
    return tensors, dropped, not_read


def hot_token_check(model, ours, problems: list) -> tuple[bool, dict]:
    """(whether SGLang's hot_token_id is d2t + arange, what else is known of it: shape, in the target vocabulary,
    matching t2d); problems where it is not ours."""
    import torch

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
    return hot_ok, hot_info


def bits(t):
    """The tensor viewed as integers of its element size: exact (NaN-safe) change detection."""
    import torch

    kind = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(kind)


def changed_rows(changed):
    """[start, stop) of the rows (dim 0) touched by a change mask, and whether they are exactly that block."""
    import torch

    per_row = changed if changed.dim() == 1 else changed.reshape(changed.shape[0], -1).any(1)
    idx = torch.nonzero(per_row).flatten()
    if idx.numel() == 0:
        return None, True
    start, stop = int(idx[0]), int(idx[-1]) + 1
    return [start, stop], idx.numel() == stop - start


def attribute_deferred_fusions(params, per_tensor, ours):
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


def overlap(ranges):
    spans = sorted(r for r in ranges if r)
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


def replay_set_embed(model):
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
