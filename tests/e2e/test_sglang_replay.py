"""SGLang's own code on our exports (eagle3lib/engines/engine_side/sglang_replay.py in .venv-sglang, CPU), so that the
pure-Python restatements of it cannot share a mistake with what they check:

- load: SGLang 0.5.17 builds LlamaForCausalLMEagle3 from our SGLang export's config.json and runs its own
  load_weights over our tensors; every parameter it binds, the shard each tensor goes to and what it drops must
  be what our gate's tables (eagle3lib.convert.gate.sglang_expected_params / sglang_bind) say.
- capture: SGLang's own set_eagle3_layers_to_capture (Kimi-K2.5 through its language model, DeepSeek-V3, Llama)
  on the config ids we write must capture our ids, as eagle3lib.engines.sglang.sglang_captured_ids says.

A small random drafter for the embedded SmolLM2, exported like tests/e2e/test_export.py does.
"""

import json
import shutil
from pathlib import Path

import pytest
from conftest import need_engine
from safetensors.torch import load_file, save_file
from test_export import ckpt  # noqa: F401  (a random drafter for the embedded target; module-scoped)

from eagle3lib.convert import gate
from eagle3lib.convert import layouts as ex
from eagle3lib.drafter.formats import read_config, read_tensors
from eagle3lib.engines.interpreter import run_engine_side
from eagle3lib.engines.sglang import sglang_captured_ids, sglang_config_ids
from eagle3lib.target import EMBEDDED_TARGET

AUX = [2, 15, 27]
EMBED = "model.embed_tokens.weight"  # the target's at serve time (set_embed), never the draft's


@pytest.fixture(scope="module")
def py():
    """.venv-sglang's interpreter: a skip without it (a failure under CI), before any export is built."""
    return need_engine("sglang")


@pytest.fixture(scope="module")
def export(py, ckpt, tmp_path_factory):  # noqa: F811
    """Our SGLang export of tests/e2e/test_export.py's random drafter for the embedded target."""
    folder, cache, _ = ckpt
    return ex.export(
        folder, "sglang", tmp_path_factory.mktemp("replay") / "sglang", target=EMBEDDED_TARGET, cache_dir=cache
    )


def renamed(src: Path, dst: Path, rename) -> Path:
    """A copy of an export with its tensors renamed by `rename` (d2t and t2d kept)."""
    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    save_file({(k if k in ("d2t", "t2d") else rename(k)): v for k, v in t.items()}, str(dst / "model.safetensors"))
    return dst


def replay_load(py, folder) -> dict:
    return run_engine_side("sglang_replay.py", ["load", str(folder)], py)


def sglang_table(report) -> dict:
    """{parameter[shard] | hot_token_id: shape} of what SGLang's own load_weights bound, from the replay."""
    table = {}
    for name, p in report["params"].items():
        for b in p["bound_from"]:
            a, z = b["rows"]
            table[name + (f"[{b['shard']}]" if b["shard"] is not None else "")] = (z - a, *p["shape"][1:])
    if report["hot_token_id"]["shape"] is not None:
        table["hot_token_id"] = tuple(report["hot_token_id"]["shape"])
    return table


def gate_disagreements(report, config: dict, names) -> list[str]:
    """Where our gate's tables (sglang_expected_params, sglang_bind) and SGLang's own load differ."""
    expected = gate.sglang_expected_params(config)
    ours = {k: tuple(v) for k, v in expected.items()}
    theirs = sglang_table(report)
    out = [
        f"{k}: gate {ours.get(k)}, SGLang {theirs.get(k)}"
        for k in sorted(set(ours) | set(theirs))
        if ours.get(k) != theirs.get(k)
    ]
    for n in names:
        key = gate.sglang_bind(n, set(expected))[0]
        got = report["tensors"][n]
        if ([key] if key else []) != got:
            out.append(f"tensor {n}: gate binds it to {key}, SGLang to {got}")
    return out


@pytest.mark.slow
def test_sglang_load_weights_binds_our_export_as_the_gate_says(py, export):
    """SGLang 0.5.17's own LlamaForCausalLMEagle3 (real model on CPU) loads every parameter but embed_tokens with
    exactly our values, drops only t2d, makes hot_token_id from d2t; and that is our gate's table."""
    r = replay_load(py, export)
    assert r["ok"], r["problems"]
    assert r["how"].startswith("real model on cpu") and r["model_class"] == "LlamaForCausalLMEagle3"
    for name, p in r["params"].items():
        if name == EMBED:
            assert p["bound_from"] == [] and not p["fully_bound"]
            continue
        assert p["fully_bound"] and p["bound_from"], name
        assert all(b["equal"] for b in p["bound_from"]), (name, p["bound_from"])
    assert r["dropped"] == ["t2d"] and r["not_read"] == []
    assert r["tensors"]["d2t"] == ["hot_token_id"] and r["hot_token_id_ok"] and r["hot_token_id"]["matches_t2d"]
    assert r["embed_shared_from_target"] and not r["load_lm_head_from_target"]
    qkv = r["params"]["model.layers.0.self_attn.qkv_proj.weight"]["bound_from"]
    assert sorted((b["rows"], b["shard"], b["tensor"]) for b in qkv) == [
        ([0, 576], "q", "midlayer.self_attn.q_proj.weight"),
        ([576, 768], "k", "midlayer.self_attn.k_proj.weight"),
        ([768, 960], "v", "midlayer.self_attn.v_proj.weight"),
    ]
    # the gate's hand copy of load_weights, checked against SGLang's own: same table, same tensor -> shard
    config = read_config(export)
    assert gate_disagreements(r, config, read_tensors(export)) == []
    assert gate.check_sglang(export)["ok"]
    # and that comparison can fail: a table that forgot hidden_norm and swapped k for q is caught
    drifted = dict(gate.sglang_expected_params(config))
    drifted.pop("model.layers.0.hidden_norm.weight")
    q, k = "model.layers.0.self_attn.qkv_proj.weight[q]", "model.layers.0.self_attn.qkv_proj.weight[k]"
    drifted[q], drifted[k] = drifted[k], drifted[q]
    assert {k: tuple(v) for k, v in drifted.items()} != sglang_table(r)


@pytest.mark.slow
def test_sglang_replay_catches_a_renamed_export(py, export, tmp_path):
    """Planted bug: tensors under `model.decoder.` (a prefix SGLang 0.5.17's load_weights cannot place: it only
    tries `name` and `model.{name}`) are dropped without a word and every parameter stays at its random init; the
    replay says so and our gate agrees tensor by tensor. `layers.0.*` names, by contrast, SGLang 0.5.17 does bind
    (model.layers.0.*): the gate refuses them only as a policy for releases before the midlayer rename."""
    bad = renamed(export, tmp_path / "decoder", lambda k: "model.decoder." + k)
    r = replay_load(py, bad)
    assert not r["ok"]
    names = read_tensors(bad)
    assert sorted(r["dropped"]) == sorted(n for n in names if n != "d2t")  # d2t still makes hot_token_id
    assert all(not p["bound_from"] and not p["fully_bound"] for p in r["params"].values())
    assert any("model.layers.0.self_attn.qkv_proj.weight" in p and "no tensor" in p for p in r["problems"])
    assert gate_disagreements(r, read_config(bad), names) == [
        f"{k}: gate {tuple(v)}, SGLang None"
        for k, v in sorted(gate.sglang_expected_params(read_config(bad)).items())
        if k != "hot_token_id"
    ]  # the gate's table still expects them: what it finds unbound is exactly what SGLang left unbound
    report = gate.check_sglang(bad)
    assert not report["ok"] and report["counts"]["skipped"] == len(names) - 2 and report["counts"]["loaded"] == 1

    legacy = renamed(export, tmp_path / "layers0", lambda k: k.replace("midlayer.", "layers.0."))
    r = replay_load(py, legacy)
    assert r["ok"], r["problems"]
    assert r["dropped"] == ["t2d"]
    assert gate_disagreements(r, read_config(legacy), read_tensors(legacy)) == []
    assert any("layers.0.*" in p for p in gate.check_sglang(legacy)["problems"])


@pytest.mark.slow
def test_sglang_capture_matches_our_id_rule(py):
    """SGLang 0.5.17's own set_eagle3_layers_to_capture on the config ids we write captures our HF ids: Kimi-K2.5
    (delegating to its DeepseekV3ForCausalLM language model) and DeepSeek-V3 on 61 layers, Llama on 30; our
    sglang_captured_ids predicts it. Planted: our ids written unconverted on Llama capture one layer later."""
    cases, want = [], []
    for arch, layers, ids in [
        ("KimiK25ForConditionalGeneration", 61, [2, 30, 58]),
        ("KimiK25ForConditionalGeneration", 61, [3, 30, 58]),
        ("DeepseekV3ForCausalLM", 61, [2, 30, 58]),
        ("DeepseekV3ForCausalLM", 61, [3, 30, 58]),
        ("LlamaForCausalLM", 30, AUX),
    ]:
        config_ids = sglang_config_ids(ids, arch)
        cases += [arch, str(layers), json.dumps(config_ids)]
        want.append((ids, sglang_captured_ids(config_ids, arch, layers)))
    cases += [
        "LlamaForCausalLM",
        "30",
        "null",
        "DeepseekV3ForCausalLM",
        "61",
        "null",
        "LlamaForCausalLM",
        "30",
        "[2, 15, 27]",
    ]
    r = run_engine_side("sglang_replay.py", ["capture", *cases], py)
    assert r["ok"], r["problems"]
    got = [c["layers_to_capture"] for c in r["cases"]]
    for (ids, predicted), captured in zip(want, got):
        assert captured == predicted == ids
    kimi = r["cases"][0]
    assert kimi["model_class"].endswith("kimi_k25.KimiK25ForConditionalGeneration")
    assert kimi["language_model_class"] == "DeepseekV3ForCausalLM" and kimi["capture_aux_hidden_states"]
    assert r["cases"][0]["ids"] == [1, 29, 57] and r["cases"][1]["ids"] == [3, 30, 58]  # the two DeepSeek branches
    assert got[5] == sglang_captured_ids(None, "LlamaForCausalLM", 30) == AUX  # no ids: SGLang's default
    assert got[6] == sglang_captured_ids(None, "DeepseekV3ForCausalLM", 61) == [2, 30, 58]
    assert got[7] == [3, 16, 28] != AUX  # the planted bug: ours, not ours - 1, in a Llama draft config
