"""speculators' own loader on our speculators export, in .venv-speculators (`make speculators-env`): a client of
03_convert's load-back gate besides the engines.

    python eagle3lib/engines/engine_side/speculators_load.py EXPORT_DIR --target TARGET

`SpeculatorModel.from_pretrained(EXPORT_DIR)`, as a user of speculators calls it: the model class from the config
(Eagle3DraftModel), the export's tensors by transformers' loader, then the verifier's embeddings, lm_head rows of
the draft vocabulary and final norm from the folder or hub id in speculators_config.verifier.name_or_path. Every
tensor of the export must equal the model's parameter or buffer of its name, and every verifier-loaded one the
target's (TARGET: the folder or hub id the gate serves with); a renamed tensor (from_pretrained drops it), a missing
one (its parameter keeps its init) and a verifier speculators cannot resolve are named. Prints one JSON report.
Standalone (stdlib, torch, safetensors and speculators only).
"""

import argparse
import json
import os
import sys
import traceback

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# a sibling in this folder, which Python puts first on sys.path when it runs this file
from report import answer, refusal  # noqa: E402

WEIGHTS = "model.safetensors"
# Eagle3DraftModel's parameters that speculators fills from the verifier, not the checkpoint
FROM_VERIFIER = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
# the target's tensors they hold, as speculators.utils.loading.load_model_layers names them
TARGET_NAMES = ("embed_tokens.weight", "lm_head.weight", "model.norm.weight")


def verifier_of(folder) -> str | None:
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    return ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")


def verifier_problem(verifier) -> str | None:
    """Why speculators cannot open the verifier the export names, or None (its own resolution: get_verifier_config,
    which from_pretrained's load_verifier_weights also goes through)."""
    if not verifier:
        return (
            "config.json names no verifier (speculators_config.verifier.name_or_path): speculators would load no "
            "embeddings and the drafter would run on NaN; re-export it with eagle3lib.convert, which names the target"
        )
    from speculators.models.utils import get_verifier_config

    try:
        get_verifier_config(verifier)
    except Exception as e:  # noqa: BLE001 - any failure to open it is the verdict
        return (
            f"speculators cannot resolve the verifier {verifier!r} (speculators_config.verifier.name_or_path): "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. It must be the target's folder or hub "
            "id; re-export with eagle3lib.convert, which writes it so"
        )
    return None


def target_tensors(target) -> dict:
    """{name: tensor} of TARGET_NAMES from the target: read here for a folder (index or single file), by
    speculators' own reader for a hub id. lm_head falls back to the embeddings (tied)."""
    if os.path.isdir(target):
        from safetensors import safe_open

        index = os.path.join(target, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                where = json.load(f)["weight_map"]
        else:
            with safe_open(os.path.join(target, WEIGHTS), framework="pt") as f:
                where = dict.fromkeys(f.keys(), WEIGHTS)
        found = {}
        for name in TARGET_NAMES:
            keys = [k for k in where if k == name or k.endswith("." + name)]
            if keys:
                key = min(keys, key=len)
                with safe_open(os.path.join(target, where[key]), framework="pt") as f:
                    found[name] = f.get_tensor(key)
    else:
        from speculators.utils.loading import load_model_layers

        found = load_model_layers(list(TARGET_NAMES), target)
    found.setdefault("lm_head.weight", found["embed_tokens.weight"])
    return found


def same(held, ours) -> bool:
    """The model holds `ours` exactly, at its own dtype (a bfloat16 model holds a float32 tensor rounded once)."""
    return tuple(held.shape) == tuple(ours.shape) and bool(ours.to(held.dtype).eq(held).all())


def _difference(held, ours) -> str:
    if tuple(held.shape) != tuple(ours.shape):
        return f"shape {tuple(held.shape)}, expected {tuple(ours.shape)}"
    if not ours.is_floating_point():
        return f"{int(ours.to(held.dtype).ne(held).sum())} of {ours.numel()} values differ"
    return f"max |difference| {float((held.float() - ours.to(held.dtype).float()).abs().max()):.3g}"


def compare(state: dict, ours: dict, target: dict, cls: str, verifier: str, target_name: str) -> tuple[list, dict]:
    """(problems, counts) of the model's state against the export's tensors and, for the verifier-loaded ones, the
    target's: a parameter is loaded when it equals every tensor it must hold."""
    lm_head = target["lm_head.weight"]
    if "t2d" in ours:
        lm_head = lm_head[ours["t2d"].bool()]
    theirs = dict(zip(FROM_VERIFIER, (target["embed_tokens.weight"], lm_head, target.get("model.norm.weight"))))
    theirs = {n: t for n, t in theirs.items() if n in state and t is not None}
    problems = [
        f"tensor {n} {tuple(t.shape)} is not a parameter of speculators' {cls}: from_pretrained drops it without a "
        "word. Export with eagle3lib.convert (speculators layout)."
        for n, t in ours.items()
        if n not in state
    ]
    skipped, loaded, missing = len(problems), 0, []
    for name, held in state.items():
        if name not in ours and name not in theirs:
            missing.append(name)
            problems.append(f"{cls}'s parameter {name} {tuple(held.shape)} gets no tensor from the export: it keeps "
                            "its init.")  # fmt: skip
            continue
        wrong = []
        if name in ours and not same(held, ours[name]):
            wrong.append(f"{cls}'s {name} is not the export's tensor ({_difference(held, ours[name])}).")
        if name in theirs and not same(held, theirs[name]):
            wrong.append(
                f"{cls}'s {name}, which speculators loads from the verifier {verifier!r}, is not the target's "
                f"({target_name}; {_difference(held, theirs[name])}): the export names another verifier than its "
                "target, or lacks a tensor speculators leaves unfilled."
            )
        problems += wrong
        loaded += not wrong
    counts = {"expected": len(state), "loaded": loaded, "skipped": skipped, "missing": len(missing), "extra": 0}
    return problems, counts


def check(folder, target) -> dict:
    from importlib.metadata import version

    from safetensors.torch import load_file

    verifier = verifier_of(folder)
    report = {"engine": "speculators", "speculators_version": version("speculators"), "verifier": verifier}
    report.update(model_class=None, target_layer_ids=None)
    refused = verifier_problem(verifier)
    if refused:
        empty = {"expected": 0, "loaded": 0, "skipped": 0, "missing": 0, "extra": 0}
        return {**report, "ok": False, "problems": [refused], "counts": empty}
    from speculators.model import SpeculatorModel

    model = SpeculatorModel.from_pretrained(folder)
    cls = type(model).__name__
    state = {n: t.detach() for n, t in model.state_dict().items()}
    problems, counts = compare(state, load_file(os.path.join(folder, WEIGHTS)), target_tensors(target), cls,
                               verifier, target)  # fmt: skip
    ids = getattr(model.config, "eagle_aux_hidden_state_layer_ids", None)
    report.update(model_class=cls, target_layer_ids=ids)
    return {**report, "ok": not problems, "problems": problems, "counts": counts}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("draft", help="the speculators export folder")
    ap.add_argument("--target", required=True, help="the target's folder or hub id, as the gate serves it")
    a = ap.parse_args(argv)
    try:
        report = check(a.draft, a.target)
    except Exception as e:  # noqa: BLE001 - speculators refusing the folder is the verdict, not a crash
        traceback.print_exc()
        report = refusal("speculators", "speculators could not load the export", e)
    return answer(report)


if __name__ == "__main__":
    sys.exit(main())
