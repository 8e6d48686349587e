"""03_convert: engine exports, imports, round trips, and the load-back gate.

A real drafter checkpoint for the embedded SmolLM2 (random weights, a real draft vocabulary and
contract), real files, and the engines' own code: vLLM's CPU build loads the exports in .venv-vllm,
SGLang's ServerArgs resolves the launch flags in .venv-sglang (`make vllm-env sglang-env`); those
tests skip, saying so, when the environment is missing.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import need_engine
from safetensors.torch import load_file, save_file

from eagle3lib.__main__ import main as cli
from eagle3lib.convert import gate
from eagle3lib.convert import layouts as ex
from eagle3lib.drafter import Drafter, DrafterConfig, formats
from eagle3lib.drafter.digests import record_digests
from eagle3lib.drafter.vocab import build_draft_vocab, d2t_sha256
from eagle3lib.engines.interpreter import run_engine_side
from eagle3lib.engines.sglang import sglang_launch_args
from eagle3lib.target import EMBEDDED_TARGET, make_contract
from eagle3lib.train.runtime.checkpoint import save_drafter

AUX = [2, 15, 27]
DRAFT_VOCAB = 2048


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, embedded_cache, embedded_target):
    """(canonical checkpoint folder, cache_dir, target folder)."""
    cache, target_dir = embedded_cache
    model, tokenizer = embedded_target
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_target(model.config, DRAFT_VOCAB, AUX))
    d2t, t2d = build_draft_vocab(torch.randint(0, 1000, (model.config.vocab_size,)), DRAFT_VOCAB)
    drafter.set_vocab(d2t, t2d)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.02)
    contract = make_contract(EMBEDDED_TARGET, model, tokenizer, AUX, "float32")
    contract.update(draft_vocab_size=DRAFT_VOCAB, d2t_sha256=d2t_sha256(d2t))
    folder = save_drafter(drafter, tmp_path_factory.mktemp("ckpt") / "drafter", contract)
    return folder, cache, target_dir


@pytest.fixture(scope="module")
def exports(ckpt, tmp_path_factory):
    folder, cache, _ = ckpt
    out = tmp_path_factory.mktemp("exports")
    return {e: ex.export(folder, e, out / e, target=EMBEDDED_TARGET, cache_dir=cache) for e in ex.ENGINES}


def same_tensors(a: Path, b: Path) -> None:
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        assert ta[k].contiguous().view(torch.uint8).equal(tb[k].contiguous().view(torch.uint8)), k  # bit-identical


def edited(src: Path, dst: Path, config=None, tensors=None) -> Path:
    """A copy of an export with config and/or tensors changed by the given functions."""
    shutil.copytree(src, dst)
    if config:
        c = json.loads((dst / "config.json").read_text())
        config(c)
        (dst / "config.json").write_text(json.dumps(c))
    if tensors:
        t = load_file(str(dst / "model.safetensors"))
        save_file(tensors(t), str(dst / "model.safetensors"))
    return dst


# --------------------------------------------------------------------------- layouts ----


def test_exports_carry_contract_and_engine_conventions(ckpt, exports):
    folder = ckpt[0]
    contract = json.loads((folder / "eagle3.json").read_text())
    for e, path in exports.items():
        assert json.loads((path / "eagle3.json").read_text()) == contract, e
    sg = json.loads((exports["sglang"] / "config.json").read_text())
    assert sg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert sg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in AUX]  # SGLang = ours - 1
    names = load_file(str(exports["sglang"] / "model.safetensors")).keys()
    assert any(n.startswith("midlayer.") for n in names) and not any(n.startswith("layers.") for n in names)
    vl = json.loads((exports["vllm"] / "config.json").read_text())
    assert vl["eagle_aux_hidden_state_layer_ids"] == AUX  # vLLM's copy; eagle_config's is SGLang's, in its convention
    assert vl["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in AUX]
    sp = json.loads((exports["speculators"] / "config.json").read_text())
    assert sp["speculators_model_type"] == "eagle3" and sp["eagle_aux_hidden_state_layer_ids"] == AUX
    assert sp["norm_before_residual"] is False and "transformer_layer_config" in sp
    assert sp["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    # the verifier as speculators opens it: the embedded target's folder, and its embeddings, which speculators
    # leaves at zeros where a checkpoint lacks them
    assert sp["speculators_config"]["verifier"]["name_or_path"] == str(ckpt[2].resolve())
    embed = load_file(str(exports["speculators"] / "model.safetensors"))["embed_tokens.weight"]
    assert torch.equal(embed, load_file(str(ckpt[2] / "model.safetensors"))["model.embed_tokens.weight"])
    assert all(
        "embed_tokens.weight" not in load_file(str(exports[e] / "model.safetensors")) for e in ("vllm", "sglang")
    )


@pytest.mark.parametrize("engine", ["sglang", "vllm", "speculators"])
def test_round_trip_is_bit_identical(ckpt, exports, engine, tmp_path):
    back = ex.import_checkpoint(exports[engine], tmp_path / "back")
    assert (
        formats.detect_layout(exports[engine])
        == {"sglang": "specforge", "vllm": "canonical", "speculators": "speculators"}[engine]
    )
    same_tensors(ckpt[0], back)
    assert json.loads((back / "config.json").read_text()) == json.loads((ckpt[0] / "config.json").read_text())
    assert json.loads((back / "eagle3.json").read_text()) == json.loads((ckpt[0] / "eagle3.json").read_text())
    # and back out again: export of the imported checkpoint equals the first export
    again = ex.export(back, engine, tmp_path / "again", cache_dir=ckpt[1])  # the contract's target, from the cache
    same_tensors(exports[engine], again)


def test_import_specforge_and_speculators_foreign_checkpoints(ckpt, exports, tmp_path):
    contract = json.loads((ckpt[0] / "eagle3.json").read_text())

    # EAGLE/SpecForge: midlayer.*, plain LlamaForCausalLM architectures, no eagle3.json, ids in SGLang's meaning
    def specforge(c):
        c["architectures"] = ["LlamaForCausalLM"]
        c["eagle_config"].pop("aux_layer_id_convention")

    sf = edited(exports["sglang"], tmp_path / "specforge", config=specforge)
    (sf / "eagle3.json").unlink()
    with pytest.raises(FileNotFoundError, match="contract"):
        ex.import_checkpoint(sf, tmp_path / "x")
    same_tensors(ckpt[0], ex.import_checkpoint(sf, tmp_path / "sf-back", contract=contract))
    # speculators with embed_tokens (the engines take the target's; dropped on import)
    sp = edited(
        exports["speculators"],
        tmp_path / "spec-embed",
        tensors=lambda t: {**t, "embed_tokens.weight": torch.zeros(49152, 576)},
    )
    same_tensors(ckpt[0], ex.import_checkpoint(sp, tmp_path / "sp-back"))
    # speculators' norm_before_residual is true when absent: imported as that EAGLE-3.1 variant, which SGLang
    # 0.5.17 does not serve (refused for it, not exported to serve another function)
    nb = edited(exports["speculators"], tmp_path / "spec-nbr", config=lambda c: c.pop("norm_before_residual"))
    back = ex.import_checkpoint(nb, tmp_path / "y")
    assert json.loads((back / "config.json").read_text())["norm_before_residual"] is True
    with pytest.raises(ValueError, match="norm_before_residual"):
        ex.export(back, "sglang", tmp_path / "y-sglang")
    assert json.loads((ex.export(back, "vllm", tmp_path / "y-vllm") / "config.json").read_text())[
        "norm_before_residual"
    ]


def test_export_refuses_another_target(ckpt, tmp_path):
    folder, cache, target_dir = ckpt
    other = tmp_path / "other-target"
    other.mkdir()
    cfg = json.loads((target_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = 24
    (other / "config.json").write_text(json.dumps(cfg))
    contract = json.loads((folder / "eagle3.json").read_text())
    with pytest.raises(ValueError) as err:
        ex.export(folder, "vllm", tmp_path / "out", target=str(other), cache_dir=cache)
    assert contract["target_fingerprint"] in str(err.value) and "fingerprint" in str(err.value)
    found = str(err.value).split("has fingerprint ")[1].split(".")[0]
    assert len(found) == 64 and found != contract["target_fingerprint"]
    assert not (tmp_path / "out").exists()


def test_a_cut_short_checkpoint_is_named_with_what_to_do(ckpt, tmp_path):
    folder = tmp_path / "cut"
    shutil.copytree(ckpt[0], folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    with pytest.raises(ValueError, match=r"cut/model.safetensors is not a readable safetensors file .*rerun the train"):
        ex.export(folder, "vllm", tmp_path / "out")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        formats.read_tensors(folder)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------- SGLang name/shape gate ----


def test_sglang_gate_passes_export(exports):
    report = gate.check_sglang(exports["sglang"])
    assert report["ok"], report["problems"]
    assert report["counts"] == {"expected": 14, "loaded": 14, "skipped": 0, "missing": 0, "extra": 0}


def _drop(key):
    return lambda t: {k: v for k, v in t.items() if k != key}


BROKEN = {
    "renamed keys": (None, lambda t: {k.replace("midlayer.", "decoder."): v for k, v in t.items()}, "not bound"),
    "missing d2t": (None, _drop("d2t"), "d2t is missing"),
    "wrong target_hidden_size": (lambda c: c.update(target_hidden_size=960), None, "target_hidden_size"),
    "wrong architectures": (lambda c: c.update(architectures=["LlamaForCausalLM"]), None, "architectures"),
    "narrower than the target": (lambda c: c.update(hidden_size=512), None, "shares the target's embeddings only"),
    "aux ids out of range": (
        lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 14, 30]),
        None,
        "out of range",
    ),
    "wrong-shaped tensor": (None, lambda t: {**t, "lm_head.weight": t["lm_head.weight"][:1000]}, "shape"),
    "layers.0 names": (None, lambda t: {k.replace("midlayer.", "layers.0."): v for k, v in t.items()}, "midlayer"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_sglang_gate_rejects_broken(exports, tmp_path, case):
    config, tensors, words = BROKEN[case]
    bad = edited(exports["sglang"], tmp_path / "bad", config=config, tensors=tensors)
    report = gate.check_sglang(bad)
    assert not report["ok"]
    assert any(words in p for p in report["problems"]), report["problems"]


def test_sglang_ids_follow_the_targets_rule(ckpt, tmp_path):
    """SGLang 0.5.17 adds 1 to a DeepSeek/Kimi target's config ids only when the first is 1: aux ids
    [3, 15, 27] must be written as they are there (ours - 1 on Llama), and the gate knows which is which."""
    src = shutil.copytree(ckpt[0], tmp_path / "deepseek-drafter")
    config, contract = json.loads((src / "config.json").read_text()), json.loads((src / "eagle3.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [3, 15, 27]
    contract.update(aux_layer_ids=[3, 15, 27], target_architecture="DeepseekV3ForCausalLM")
    (src / "config.json").write_text(json.dumps(config))
    (src / "eagle3.json").write_text(json.dumps(contract))
    record_digests(src)  # changed on purpose: the folder's digests say so
    out = ex.export(src, "sglang", tmp_path / "sglang")
    assert json.loads((out / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
        3,
        15,
        27,
    ]
    assert gate.check_sglang(out)["ok"]
    llama_ids = edited(
        out,
        tmp_path / "llama-ids",
        config=lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 14, 26]),
    )
    report = gate.check_sglang(llama_ids)
    assert not report["ok"] and any("[2, 14, 26]" in p for p in report["problems"]), report["problems"]


def test_cli_convert_and_verify(ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(ckpt[1]))
    out = tmp_path / "sg"
    assert cli(["convert", str(ckpt[0]), "--to", "sglang", "--out", str(out)]) == 0
    assert cli(["verify", str(out), "--engine", "sglang", "--python", "/nonexistent/python"]) == 2  # no such engine
    bad = edited(out, tmp_path / "bad", tensors=_drop("d2t"))
    assert cli(["verify", str(bad), "--engine", "sglang"]) == 1  # with or without .venv-sglang
    assert "d2t is missing" in capsys.readouterr().err


# ------------------------------------------------------------------ engines' own code ----


need = need_engine  # the engine's own code judges the export


@pytest.mark.slow
@pytest.mark.parametrize(
    "variants",
    [{}, {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True}],
    ids=["eagle3", "eagle31-speculators-defaults"],
)
def test_vllm_forward_equals_our_drafter_step(ckpt, exports, embedded_target, tmp_path, variants):
    """vLLM's own Eagle3LlamaForCausalLM, loaded from our export, against Drafter.step on the same 9 positions of
    the target's embeddings and random aux states: same state for the next step, same logits over the target's
    vocabulary (fc on the aux states, the embeds/hidden order, norms, q/k/v split, rotary, MLP and d2t; the
    attention kernel is a plain causal softmax on vLLM's side: engines/engine_side/load_check.py). Also with
    EAGLE-3.1's norms as speculators' eagle3 defaults set them (vLLM implements each of them)."""
    from eagle3lib.drafter import DraftCache
    from eagle3lib.train.runtime.checkpoint import load_drafter

    py = need("vllm")
    model = embedded_target[0]
    base = load_drafter(ckpt[0])
    drafter = Drafter(DrafterConfig(**{**base.cfg.as_dict(), **variants})).eval()
    drafter.load_state_dict(base.state_dict(), strict=False)
    with torch.no_grad():  # norms near 1, as trained ones are (the fixture's are ~0.02: logits near zero)
        for norm in (drafter.norm, drafter.layer.input_layernorm, drafter.layer.hidden_norm):
            norm.weight.add_(1.0)
        drafter.layer.post_attention_layernorm.weight.add_(1.0)
        if variants.get("norm_before_fc"):
            drafter.input_norm.weight.uniform_(0.5, 1.5)
    folder = save_drafter(drafter, tmp_path / "drafter", json.loads((ckpt[0] / "eagle3.json").read_text()))
    export = ex.export(folder, "vllm", tmp_path / "vllm", target=EMBEDDED_TARGET, cache_dir=ckpt[1])
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (9,))
    embeds = model.get_input_embeddings().weight[ids].detach().float()
    aux = torch.randn(9, 3 * model.config.hidden_size)
    positions = torch.arange(9)
    inputs, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file({"input_embeds": embeds.contiguous(), "aux": aux, "positions": positions}, str(inputs))
    report = run_engine_side(
        "load_check.py",
        ["vllm-forward", str(export), "--target", str(ckpt[2]), "--inputs", str(inputs), "--out", str(out)],
        py,
    )
    assert report["ok"] and report["model_class"] == "Eagle3LlamaForCausalLM", report
    theirs = load_file(str(out))
    with torch.no_grad():
        hidden, logits = drafter.step(DraftCache(), embeds[None], aux[None], positions[None], from_target=True)
    ours = torch.full((9, model.config.vocab_size), float("-inf"))
    ours[:, drafter.draft_to_target(torch.arange(drafter.cfg.draft_vocab_size))] = logits[0]
    assert torch.equal(torch.isfinite(theirs["logits"]), torch.isfinite(ours))  # the same draft vocabulary
    finite = torch.isfinite(ours)
    scale = ours[finite].abs().max()
    assert (theirs["logits"][finite] - ours[finite]).abs().max() <= 1e-4 * scale
    assert (theirs["prenorm"] - hidden[0]).abs().max() <= 1e-4 * hidden.abs().max()
    assert torch.equal(theirs["logits"].argmax(-1), ours.argmax(-1))


@pytest.mark.parametrize("engine", ["vllm", "speculators"])
def test_vllm_loads_export(ckpt, exports, engine):
    need("vllm")
    report = gate.verify(exports[engine], "vllm", cache_dir=ckpt[1])
    assert report["ok"], report["problems"]
    assert report["model_class"] == "Eagle3LlamaForCausalLM" and report["captured_hf_layers"] == AUX
    n = {"vllm": 11, "speculators": 12}[engine]  # and the target's embeddings, which a speculators export carries
    assert report["counts"] == {"expected": n, "loaded": n, "skipped": 0, "missing": 0, "extra": 0}


def test_vllm_rejects_broken(ckpt, exports, tmp_path):
    need("vllm")
    bad = edited(
        exports["vllm"],
        tmp_path / "renamed",
        tensors=lambda t: {k.replace("mlp.down_proj", "mlp.out_proj"): v for k, v in t.items()},
    )
    report = gate.verify(bad, "vllm", cache_dir=ckpt[1])
    assert not report["ok"] and any("out_proj" in p for p in report["problems"]), report["problems"]
    nbr = edited(exports["speculators"], tmp_path / "nbr", config=lambda c: c.pop("norm_before_residual"))
    report = gate.verify(nbr, "vllm", cache_dir=ckpt[1])
    assert not report["ok"] and any("norm_before_residual" in p for p in report["problems"]), report["problems"]


def test_sglang_server_args_resolve(ckpt, exports):
    py = need("sglang")
    report = gate.verify(exports["sglang"], "sglang", cache_dir=ckpt[1], depth=5)
    assert report["ok"], report["problems"]
    assert report["server_args"]["resolved"]["speculative_num_draft_tokens"] == 6
    assert report["server_args"]["captured_hf_layers"] == AUX
    # SGLang itself takes EAGLE for an EAGLE-3 drafter without a word, and then feeds no aux states:
    args = ["--model-path", str(ckpt[2]), "--device", "cpu"] + sglang_launch_args(exports["sglang"], 3)
    args[args.index("EAGLE3")] = "EAGLE"
    resolved = run_engine_side("load_check.py", ["sglang", "--args", json.dumps(args)], py)
    assert resolved["resolved"]["speculative_algorithm"] == "EAGLE"
    assert any("EAGLE3" in p for p in resolved["problems"])
