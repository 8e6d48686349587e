"""03_convert for an MLA drafter (TorchSpec's Eagle3DeepseekV2ForCausalLM, the layer of the best public Kimi-K2.5
drafters): import of a TorchSpec-style checkpoint, exports for SGLang and vLLM, the load-back gate in each engine's
own loader, round trips, and Kimi-K2.5's real dims.

A small random MLA drafter (state dict made directly at the shapes drafter/layer_kinds.py gives; both engines'
loaders check those shapes) for a small random-config DeepSeek-V3 target (config only: the gates build the draft,
never the target). The engines' code runs in .venv-sglang (kimi_k25_eagle3.py, built and loaded on the CPU) and
.venv-vllm (deepseek_eagle3.py, vLLM's CPU build); those tests skip without them (fail under CI).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import KIMI_FIXTURES, need_engine
from safetensors.torch import load_file, save_file

from eagle3lib.convert import gate
from eagle3lib.convert import layouts as ex
from eagle3lib.drafter import formats
from eagle3lib.drafter.layer_kinds import MLA, layer_kind
from eagle3lib.drafter.vocab import d2t_sha256
from eagle3lib.engines.interpreter import run_engine_side

H, HEADS, Q_RANK, KV_RANK, NOPE, ROPE, V_DIM, INTER = 64, 4, 32, 16, 16, 8, 16, 128
VOCAB, DRAFT_VOCAB, TARGET_LAYERS = 256, 128, 8
AUX = [2, 4, 6]  # ours (HF hidden_states); SGLang's config ids [1, 3, 5] on a DeepSeek-V3 target
# Yarn as Kimi-K2.5 has it: SGLang's CPU rope (get_rope_cpu) asserts a rope_scaling for DeepSeek's attention.
YARN = {
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "factor": 64.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn",
}
MLA_KEYS = {
    "hidden_size": H,
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "q_lora_rank": Q_RANK,
    "kv_lora_rank": KV_RANK,
    "qk_nope_head_dim": NOPE,
    "qk_rope_head_dim": ROPE,
    "v_head_dim": V_DIM,
    "intermediate_size": INTER,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rope_theta": 50000.0,
    "rope_scaling": YARN,
    "tie_word_embeddings": False,
}


def torchspec_config(**changes) -> dict:
    """config.json as TorchSpec's kimi_k25_eagle3_mla.json has it, at small dims: kimi_k2 model type, aux ids in
    SGLang's convention under eagle_config and TorchSpec's own eagle_config keys."""
    c = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "kimi_k2",
        **MLA_KEYS,
        "num_hidden_layers": 1,
        "draft_vocab_size": DRAFT_VOCAB,
        "torch_dtype": "float32",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in AUX],
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": True,
        },
    }
    c.update(changes)
    return c


def torchspec_tensors(config: dict) -> dict:
    """Random tensors of an MLA drafter as TorchSpec's save_pretrained names them (midlayer.*, kv_a_proj, the
    target's embed_tokens); d2t maps draft id i to target id 2i."""
    torch.manual_seed(0)
    shapes = MLA.shapes(config)
    out = {}
    for name, shape in shapes.items():
        if name in ("d2t", "t2d"):
            continue
        ts_name = name.replace("layers.0.", "midlayer.").replace("kv_a_proj_with_mqa", "kv_a_proj")
        out[ts_name] = torch.randn(*shape) * 0.05 + (1.0 if len(shape) == 1 else 0.0)
    out["embed_tokens.weight"] = torch.randn(VOCAB, H)
    out["d2t"] = torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[2 * torch.arange(DRAFT_VOCAB)] = True
    out["t2d"] = t2d
    return out


def config_folder(tmp_path_factory, name: str, config: dict) -> Path:
    """A target's folder holding its config.json only (the gates build the draft, never the target)."""
    folder = tmp_path_factory.mktemp(name)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A DeepSeek-V3 target's folder (config.json only: MLA attention, the drafter's width and vocabulary)."""
    config = {
        **MLA_KEYS,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_hidden_layers": TARGET_LAYERS,
        "first_k_dense_replace": TARGET_LAYERS,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "torch_dtype": "float32",
    }
    return config_folder(tmp_path_factory, "deepseek-target", config)


def write(folder: Path, config: dict, tensors: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def torchspec(tmp_path_factory) -> Path:
    """A TorchSpec-style MLA checkpoint: no eagle3.json, midlayer.* names, kv_a_proj, embed_tokens."""
    config = torchspec_config()
    return write(tmp_path_factory.mktemp("torchspec") / "drafter", config, torchspec_tensors(config))


@pytest.fixture(scope="module")
def canonical(torchspec, target, tmp_path_factory) -> Path:
    """The TorchSpec checkpoint imported for the target (convert's import with --target)."""
    return ex.import_checkpoint(torchspec, tmp_path_factory.mktemp("canonical") / "drafter", target=str(target))


@pytest.fixture(scope="module")
def exports(canonical, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("mla-exports")
    return {e: ex.export(canonical, e, out / e) for e in ("sglang", "vllm")}


def same_tensors(a: Path, b: Path) -> None:
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        assert ta[k].contiguous().view(torch.uint8).equal(tb[k].contiguous().view(torch.uint8)), k


def edited(src: Path, dst: Path, tensors) -> Path:
    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    save_file(tensors(t), str(dst / "model.safetensors"))
    return dst


# ------------------------------------------------------------------------------ import ----


def test_torchspec_checkpoint_imports_to_the_canonical_mla_form(torchspec, canonical):
    config = json.loads((canonical / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "deepseek_v2"
    assert layer_kind(config) is MLA
    assert {k: config[k] for k in MLA_KEYS} == MLA_KEYS  # DeepSeek's keys kept as TorchSpec wrote them
    assert config["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": AUX,
        "aux_layer_id_convention": "hf_hidden_states",
    }
    contract = json.loads((canonical / "eagle3.json").read_text())
    assert contract["target_architecture"] == "DeepseekV3ForCausalLM" and contract["aux_layer_ids"] == AUX
    theirs, ours = load_file(str(torchspec / "model.safetensors")), load_file(str(canonical / "model.safetensors"))
    assert sorted(ours) == sorted(MLA.tensors(config))  # embed_tokens dropped, every name canonical
    assert torch.equal(
        ours["layers.0.self_attn.kv_a_proj_with_mqa.weight"], theirs["midlayer.self_attn.kv_a_proj.weight"]
    )
    assert torch.equal(ours["layers.0.self_attn.q_a_proj.weight"], theirs["midlayer.self_attn.q_a_proj.weight"])
    assert contract["d2t_sha256"] == d2t_sha256(ours["d2t"])


def test_import_refuses_mla_weights_of_other_shapes(tmp_path, target):
    config = torchspec_config()
    tensors = torchspec_tensors(config)
    tensors["midlayer.self_attn.q_a_proj.weight"] = torch.zeros(Q_RANK, H)  # a GQA-style 1H input, not 2H
    bad = write(tmp_path / "bad", config, tensors)
    with pytest.raises(ValueError, match=r"layers.0.self_attn.q_a_proj.weight \(32, 64\) \(expected \(32, 128\)\)"):
        ex.import_checkpoint(bad, tmp_path / "out", target=str(target))


# ------------------------------------------------------------------------------ export ----


def test_exports_carry_what_each_engine_reads(canonical, exports):
    sg = json.loads((exports["sglang"] / "config.json").read_text())
    assert sg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and sg["model_type"] == "deepseek_v2"
    assert sg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in AUX]  # DeepSeek target rule
    assert sg["q_lora_rank"] == Q_RANK and sg["draft_vocab_size"] == DRAFT_VOCAB
    names = load_file(str(exports["sglang"] / "model.safetensors")).keys()
    assert "midlayer.self_attn.kv_a_proj_with_mqa.weight" in names and not any(n.startswith("layers.") for n in names)
    vl = json.loads((exports["vllm"] / "config.json").read_text())
    assert vl["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and vl["eagle_aux_hidden_state_layer_ids"] == AUX
    assert sorted(load_file(str(exports["vllm"] / "model.safetensors"))) == sorted(MLA.tensors(vl))


def test_speculators_export_is_refused_saying_why(canonical, tmp_path):
    with pytest.raises(ValueError, match=r"MLA.*speculators 0.9.0 builds eagle3 layers for the model types llama"):
        ex.export(canonical, "speculators", tmp_path / "sp")
    assert not (tmp_path / "sp").exists()
    assert ex.exportable_engines(canonical) == {
        "sglang": None,
        "vllm": None,
        "speculators": ex.export_refusal("speculators", MLA, {}),
    }


def test_engine_refusals_of_mla_configs(canonical, tmp_path):
    no_q_rank = shutil.copytree(canonical, tmp_path / "no-q-rank")
    config = json.loads((no_q_rank / "config.json").read_text())
    assert ex.export_refusal("sglang", MLA, {**config, "q_lora_rank": None}).startswith("its config has no q_lora_rank")
    assert ex.export_refusal("vllm", MLA, {**config, "q_lora_rank": None}) is None  # vLLM's q_proj path
    assert "input_norm" in ex.export_refusal("vllm", MLA, {**config, "norm_before_fc": True})
    assert "residual" in ex.export_refusal("sglang", MLA, {**config, "norm_before_residual": True})


@pytest.fixture(scope="module")
def llama_target(tmp_path_factory) -> Path:
    """A Llama-shaped target's folder (config.json only: grouped-query attention, no latent)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_hidden_layers": TARGET_LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "torch_dtype": "float32",
    }
    return config_folder(tmp_path_factory, "llama-target", config)


def test_vllm_is_refused_an_mla_draft_over_a_target_without_mla(canonical, target, llama_target, tmp_path):
    # vLLM 0.32's MLA metadata takes its head size from the target's config: over a GQA target every request fails
    over_llama = ex.exportable_engines(canonical, target=str(llama_target))
    assert over_llama["sglang"] is None
    assert "target's attention is not" in over_llama["vllm"] and "engine.name: sglang" in over_llama["vllm"]
    assert ex.exportable_engines(canonical, target=str(target))["vllm"] is None  # a DeepSeek-V3 target: served
    assert ex.exportable_engines(canonical)["vllm"] is None  # no target given: nothing to judge it by


def test_convert_stops_before_exporting_when_the_runs_engine_cannot_serve(canonical, llama_target, tmp_path):
    from types import SimpleNamespace

    from eagle3lib.convert import notebook

    p = SimpleNamespace(
        target=SimpleNamespace(name=str(llama_target)),
        engine=SimpleNamespace(name="vllm"),
        run=SimpleNamespace(cache_dir=str(tmp_path / "cache")),
        bench=SimpleNamespace(depths=[3]),
    )
    with pytest.raises(ValueError, match=r"engine.name: vllm, which cannot serve this drafter.*kept in"):
        notebook.export_all(p, canonical, tmp_path / "out")
    assert not (tmp_path / "out").exists() and (canonical / "model.safetensors").is_file()


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_round_trip_is_bit_identical(canonical, exports, engine, tmp_path):
    assert formats.detect_layout(exports[engine]) == {"sglang": "specforge", "vllm": "canonical"}[engine]
    back = ex.import_checkpoint(exports[engine], tmp_path / "back")
    same_tensors(canonical, back)
    assert json.loads((back / "config.json").read_text()) == json.loads((canonical / "config.json").read_text())
    assert json.loads((back / "eagle3.json").read_text()) == json.loads((canonical / "eagle3.json").read_text())
    same_tensors(exports[engine], ex.export(back, engine, tmp_path / "again"))


# ----------------------------------------------------------------- engines' own loaders ----

MISSING = "self_attn.kv_a_proj_with_mqa.weight"  # q_a_proj then waits for it forever: fused_qkv_a_proj stays random


def test_sglang_gate_binds_every_tensor(exports):
    report = gate.verify(exports["sglang"], "sglang", python=need_engine("sglang"))
    assert report["ok"], report["problems"]
    assert report["model_class"] == "Eagle3DeepseekV2ForCausalLM" and report["layer_kind"] == "mla"
    # 13 parameters (fused_qkv_a_proj_with_mqa from q_a_proj + kv_a_proj_with_mqa, gate_up_proj from gate + up),
    # lm_head, and hot_token_id from d2t; the target's embed_tokens is not the draft's
    assert report["counts"] == {"expected": 15, "loaded": 15, "skipped": 0, "missing": 0, "extra": 0}
    assert report["server_args"]["captured_hf_layers"] == AUX


@pytest.mark.parametrize(
    "case, change, words",
    [
        ("renamed", lambda t: {k.replace("kv_b_proj", "kv_up_proj"): v for k, v in t.items()}, "kv_up_proj"),
        ("missing", lambda t: {k: v for k, v in t.items() if not k.endswith(MISSING)}, MISSING),
    ],
)
def test_sglang_gate_refuses_a_renamed_or_missing_tensor(exports, tmp_path, case, change, words):
    bad = edited(exports["sglang"], tmp_path / case, change)
    report = gate.verify(bad, "sglang", python=need_engine("sglang"))
    assert not report["ok"] and report["counts"]["loaded"] < report["counts"]["expected"]
    assert any(words in p for p in report["problems"]), report["problems"]
    # SGLang's own loader saw it too: a parameter left at its random init
    assert any("gets no tensor" in p or "dropped by SGLang" in p for p in report["problems"]), report["problems"]


def test_vllm_gate_binds_every_tensor(exports):
    report = gate.verify(exports["vllm"], "vllm", python=need_engine("vllm"))
    assert report["ok"], report["problems"]
    assert report["model_class"] == "Eagle3DeepseekV2ForCausalLM" and report["captured_hf_layers"] == AUX
    # fused_qkv_a_proj (q_a_proj + kv_a_proj_with_mqa), gate_up_proj, 11 others, lm_head, draft_id_to_target_id
    assert report["counts"] == {"expected": 15, "loaded": 15, "skipped": 0, "missing": 0, "extra": 0}


@pytest.mark.parametrize(
    "case, change, words",
    [
        ("renamed", lambda t: {k.replace("kv_b_proj", "kv_up_proj"): v for k, v in t.items()}, "kv_up_proj"),
        ("missing", lambda t: {k: v for k, v in t.items() if not k.endswith(MISSING)}, MISSING),
    ],
)
def test_vllm_gate_refuses_a_renamed_or_missing_tensor(exports, tmp_path, case, change, words):
    bad = edited(exports["vllm"], tmp_path / case, change)
    report = gate.verify(bad, "vllm", python=need_engine("vllm"))
    assert not report["ok"]
    assert any(words in p for p in report["problems"]), report["problems"]


@pytest.mark.parametrize(
    "rope",
    [{"rope_type": "yarn", "rope_theta": 50000.0, **{k: v for k, v in YARN.items() if k != "type"}}, None],
    ids=["yarn", "plain-rope"],
)
def test_our_mla_drafter_exports_and_binds_in_both_engines(canonical, tmp_path, rope):
    """drafter/model.py's own MLA drafter (DrafterConfig draft_attention mla), saved as 02_train saves it: its
    tensors are the kind's, and each engine's loader binds every one of them; with Kimi's YaRN rope and with a plain
    one (rope_scaling null, which SGLang's CPU rope refuses: sglang_replay builds that rope as a GPU server does)."""
    from eagle3lib.drafter import Drafter, DrafterConfig
    from eagle3lib.train.runtime.checkpoint import save_drafter

    dims = {k: MLA_KEYS[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")}
    cfg = DrafterConfig(
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        head_dim=ROPE,
        intermediate_size=INTER,
        vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
        target_hidden_size=H,
        aux_layer_ids=AUX,
        max_position_embeddings=4096,
        **({"rope_parameters": rope} if rope else {}),
        draft_attention="mla",
        v_head_dim=V_DIM,
        **dims,
    )
    torch.manual_seed(1)
    drafter = Drafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.02)
    ours = load_file(str(canonical / "model.safetensors"))
    drafter.set_vocab(ours["d2t"], ours["t2d"])
    folder = save_drafter(drafter, tmp_path / "drafter", json.loads((canonical / "eagle3.json").read_text()))
    config = json.loads((folder / "config.json").read_text())
    assert layer_kind(config) is MLA
    assert {n: tuple(t.shape) for n, t in load_file(str(folder / "model.safetensors")).items()} == MLA.shapes(config)
    for engine in ("sglang", "vllm"):
        out = ex.export(folder, engine, tmp_path / engine)
        report = gate.verify(out, engine, python=need_engine(engine))
        assert report["ok"], (engine, report["problems"])
        assert report["counts"]["loaded"] == report["counts"]["expected"] == 15, (engine, report["counts"])
        same_tensors(folder, ex.import_checkpoint(out, tmp_path / f"{engine}-back"))


# ------------------------------------------------------------------- Kimi-K2.5's real dims ----

KIMI_AUX = [2, 30, 58]  # ours; TorchSpec's kimi_k25_eagle3_mla.json writes SGLang's [1, 29, 57]


@pytest.fixture(scope="module")
def kimi_export(kimi_folder, kimi_fixtures, tmp_path_factory):
    """Shapes-only exports of an MLA drafter for Kimi-K2.5 (hidden 7168: 1.8e9 parameters, so meta tensors, with
    real d2t/t2d): {engine: (folder with the export's config.json and shapes.json, canonical config)}."""
    from eagle3lib.drafter import DrafterConfig
    from eagle3lib.target import load_config

    config = DrafterConfig.from_target(load_config(kimi_folder), 163840, KIMI_AUX, draft_attention="mla").to_hf_dict()
    root = tmp_path_factory.mktemp("kimi-mla")
    (root / "config.json").write_text(json.dumps(config))
    contract = {**ex.target_contract(str(kimi_folder), root), "aux_layer_ids": KIMI_AUX, "draft_vocab_size": 163840}
    tensors = {
        n: torch.zeros(s, dtype={"d2t": torch.int64, "t2d": torch.bool}[n])
        if n in ("d2t", "t2d")
        else torch.empty(s, device="meta")
        for n, s in MLA.shapes(config).items()
    }
    out = {}
    for engine in ("sglang", "vllm"):
        cfg, named = ex.engine_layout(engine, config, tensors, contract)
        folder = root / engine
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(cfg))
        (folder / "shapes.json").write_text(json.dumps({n: list(t.shape) for n, t in named.items()}))
        out[engine] = folder
    return out, config


def test_kimi_drafter_has_torchspecs_mla_layer(kimi_export, kimi_fixtures):
    """Our MLA drafter for Kimi-K2.5 has the layer of TorchSpec's (lightseekorg/kimi-k2.5-eagle3-mla's config)."""
    config = kimi_export[1]
    theirs = json.loads((kimi_fixtures / "drafter_configs" / "torchspec_kimi_k25_eagle3_mla.json").read_text())
    keys = [*MLA.config_keys, "num_key_value_heads", "draft_vocab_size", "rope_theta"]
    assert {k: config[k] for k in keys} == {k: theirs[k] for k in keys}
    assert MLA.shapes(config)["layers.0.self_attn.q_a_proj.weight"] == (1536, 2 * 7168)  # the 2H input


def kimi_meta_load(engine, folder, shapes_file):
    """The engine's meta-device build and load of the export in `folder` with the tensors of `shapes_file`."""
    if engine == "sglang":
        return run_engine_side("sglang_replay.py", ["meta-load", str(folder), str(shapes_file)], need_engine(engine))
    # vLLM's Kimi-K2.5 class reads the image processor's preprocessor_config.json at config time, which was not
    # published verbatim (fixtures' SOURCES.md): the target is its language model, DeepseekV3ForCausalLM, as
    # config.json's text_config has it (the int4 quantization_config left out: it is the target's, never the draft's)
    text = dict(json.loads((KIMI_FIXTURES / "config.json").read_text())["text_config"])
    text.pop("quantization_config")
    target = folder.parent / "kimi-text"
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text(json.dumps(text))
    args = ["vllm-meta", str(folder), "--target", str(target), "--shapes", str(shapes_file)]
    return run_engine_side("load_check.py", args, need_engine(engine))


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_kimi_export_shapes_are_accepted_by_the_engines_loader(kimi_export, engine, tmp_path):
    """Each engine builds its Eagle3DeepseekV2ForCausalLM from the export's config.json at Kimi-K2.5's dims (meta
    device) and its own load_weights takes every tensor of the export at its shape; a q_a_proj over one H instead
    of the concatenated 2H is refused."""
    folder = kimi_export[0][engine]
    shapes = json.loads((folder / "shapes.json").read_text())
    report = kimi_meta_load(engine, folder, folder / "shapes.json")
    assert report["ok"], report["problems"]
    assert report["model_class"] == "Eagle3DeepseekV2ForCausalLM"
    fused = {
        "sglang": "model.midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight",
        "vllm": "model.layers.0.self_attn.fused_qkv_a_proj.weight",
    }
    assert report["params"][fused[engine]] == [1536 + 512 + 64, 2 * 7168]
    assert report["params"]["lm_head.weight"] == [163840, 7168] and report["params"]["model.fc.weight"] == [
        7168,
        3 * 7168,
    ]
    q_a = next(n for n in shapes if n.endswith("q_a_proj.weight"))
    (tmp_path / "bad.json").write_text(json.dumps({**shapes, q_a: [1536, 7168]}))
    bad = kimi_meta_load(engine, folder, tmp_path / "bad.json")
    assert not bad["ok"] and any("refused" in p for p in bad["problems"]), bad["problems"]
