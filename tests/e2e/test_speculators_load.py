"""speculators' own library opens our speculators exports: `SpeculatorModel.from_pretrained` in .venv-speculators
(`make speculators-env`), run by the load-back gate's speculators client (convert/speculators_gate.py), loads every
tensor of the export and the verifier's embeddings, lm_head rows and final norm from the target the export names.

Exports of a drafter over the embedded target, over a `tiny:` copy (only its folder in the cache exists), and of a
drafter speculators wrote itself, converted with --target; a renamed or missing tensor and a verifier speculators
cannot resolve are refused, named.
"""

# ruff: noqa: F811 (the fixtures of test_export and test_convert_foreign, imported, are its tests' arguments)
import json
from pathlib import Path

import pytest
import torch
from conftest import need_engine
from safetensors.torch import load_file
from test_convert_foreign import SPECULATORS_AUX, llama_target, run_cli, speculators_checkpoint  # noqa: F401
from test_export import AUX, ckpt, edited  # noqa: F401

from eagle3lib.convert import gate, layouts
from eagle3lib.drafter import Drafter, DrafterConfig
from eagle3lib.drafter.vocab import build_draft_vocab, d2t_sha256
from eagle3lib.target import EMBEDDED_TARGET, load_target, make_contract
from eagle3lib.train.runtime.checkpoint import save_drafter

DRAFT_VOCAB = 2048


def opened(folder: Path, target=None, cache=None) -> dict:
    """The speculators gate's report on an export, which must pass with every tensor loaded."""
    need_engine("speculators")
    report = gate.verify(folder, "speculators", target=target, cache_dir=cache)
    assert report["ok"], report["problems"]
    counts = report["counts"]
    assert counts["loaded"] == counts["expected"] and counts["skipped"] == counts["missing"] == 0, counts
    assert report["model_class"] == "Eagle3DraftModel"
    return report


def verifier(folder: Path) -> str:
    return json.loads((folder / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]


@pytest.fixture(scope="module")
def embedded_export(ckpt, tmp_path_factory):
    folder, cache, _ = ckpt
    out = tmp_path_factory.mktemp("speculators") / "embedded"
    return layouts.export(folder, "speculators", out, target=EMBEDDED_TARGET, cache_dir=cache)


def test_the_embedded_targets_export_opens_with_every_tensor(ckpt, embedded_export):
    report = opened(embedded_export, cache=ckpt[1])
    assert report["verifier"] == verifier(embedded_export) == str(ckpt[2].resolve())  # its folder in the cache
    assert report["target_layer_ids"] == AUX
    # every tensor of the export, and the verifier's embeddings, lm_head rows and norm
    assert report["counts"]["expected"] == len(load_file(str(embedded_export / "model.safetensors"))) + 2


def test_a_tiny_copys_export_names_its_folder(embedded_cache, tmp_path):
    """A GQA drafter over a `tiny:` copy of a Llama-like model (the embedded SmolLM2's folder): the name exists only
    here, so the export names the copy's folder."""
    cache, source = embedded_cache
    name = f"tiny:{source}"
    model, tokenizer = load_target(name, cache)
    aux = [2, 4, 5]
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_target(model.config, DRAFT_VOCAB, aux))
    d2t, t2d = build_draft_vocab(torch.randint(0, 1000, (model.config.vocab_size,)), DRAFT_VOCAB)
    drafter.set_vocab(d2t, t2d)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.02)
    contract = make_contract(name, model, tokenizer, aux, "float32")
    contract.update(draft_vocab_size=DRAFT_VOCAB, d2t_sha256=d2t_sha256(d2t))
    folder = save_drafter(drafter, tmp_path / "drafter", contract)
    export = layouts.export(folder, "speculators", tmp_path / "speculators", target=name, cache_dir=cache)
    assert not verifier(export).startswith("tiny:") and (Path(verifier(export)) / "config.json").is_file()
    report = opened(export, cache=cache)
    assert report["target_layer_ids"] == aux


def test_a_foreign_drafter_converted_with_target_names_that_target(
    speculators_checkpoint, llama_target, tmp_path, capsys
):
    """A drafter speculators wrote, converted with --target: the export names that target, and holds every tensor
    speculators saved, bit for bit (the verifier's rows speculators does not save are compared with the target's)."""
    out = tmp_path / "speculators"
    rc, _, err = run_cli(capsys, "convert", speculators_checkpoint, "--to", "speculators", "--out", out,
                         "--target", llama_target)  # fmt: skip
    assert rc == 0, err
    assert verifier(out) == str(llama_target.resolve())
    theirs = load_file(str(speculators_checkpoint / "model.safetensors"))
    ours = load_file(str(out / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    rc, printed, err = run_cli(capsys, "verify", out, "--engine", "speculators")
    assert rc == 0 and "speculators gate: PASS" in printed, printed + err
    assert opened(out)["target_layer_ids"] == SPECULATORS_AUX


def test_a_renamed_or_missing_tensor_and_an_unresolvable_verifier_are_refused(ckpt, embedded_export, tmp_path):
    need_engine("speculators")
    cache = ckpt[1]

    def broken(tensors):
        tensors = {n.replace("mlp.down_proj", "mlp.out_proj"): t for n, t in tensors.items()}
        return {n: t for n, t in tensors.items() if n != "fc.weight"}

    bad = edited(embedded_export, tmp_path / "renamed", tensors=broken)
    report = gate.verify(bad, "speculators", cache_dir=cache)
    problems = "\n".join(report["problems"])
    assert not report["ok"] and report["counts"]["skipped"] == 1 and report["counts"]["missing"] == 2, report
    assert "tensor layers.0.mlp.out_proj.weight" in problems and "drops it" in problems, problems
    assert "parameter layers.0.mlp.down_proj.weight" in problems and "parameter fc.weight" in problems, problems

    def ours(config):
        config["speculators_config"]["verifier"]["name_or_path"] = EMBEDDED_TARGET

    unresolvable = edited(embedded_export, tmp_path / "verifier", config=ours)
    report = gate.verify(unresolvable, "speculators", cache_dir=cache)
    assert not report["ok"] and len(report["problems"]) == 1, report["problems"]
    assert f"cannot resolve the verifier {EMBEDDED_TARGET!r}" in report["problems"][0], report["problems"]
