"""sglang_replay.py's meta-load: a full-size draft model on the meta device, loaded by SGLang's own load_weights
from meta tensors of our export's names and shapes, so that SGLang's weight loaders assert every shape without the
memory. Standalone (stdlib, torch and SGLang only)."""

import json

from sglang_load import SHARED_FROM_TARGET
from sglang_model import construct, record_weight_loaders, sglang_setup


def meta_load_report(config_dir, shapes_json, dtype="bfloat16"):
    """SGLang's draft model built on the meta device from config_dir, its load_weights fed meta tensors of the
    shapes in shapes_json (see sglang_replay.py's meta-load)."""
    import sglang
    import torch
    from sglang.srt.configs.load_config import LoadConfig

    with open(shapes_json) as f:
        shapes = json.load(f)
    model_config = sglang_setup(config_dir, dtype)
    # SGLang's registry imports its model modules on first lookup; some make tensors at import, which must not be
    # on the meta device: look the class up first, then build it there.
    from sglang.srt.model_loader.utils import get_model_architecture

    get_model_architecture(model_config)
    model, how, _ = construct(model_config, LoadConfig(), device="meta")
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    params = dict(model.named_parameters())
    calls, current = [], {"name": None}
    # a parameter without its own loader gets default_weight_loader (load_weights' getattr default)
    record_weight_loaders(params, calls, current, default_weight_loader)

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
