"""The load-back gate's speculators client: speculators' own `SpeculatorModel.from_pretrained` opens the speculators
export in speculators' interpreter (.venv-speculators; engines/engine_side/speculators_load.py), every tensor is
compared with the export's and every verifier-loaded one with the target's, and the layers it reads from the target
with the ones the drafter was trained on."""

from __future__ import annotations

from eagle3lib.engines.interpreter import run_engine_side

SPECULATORS_PACKAGE = "0.9.0"  # the speculators release the gate runs (`make speculators-env`)


def check_speculators(folder, contract: dict, target_dir: str, python: str | None) -> dict:
    """The speculators gate of a speculators export: {engine, ok, problems, counts, model_class, verifier, ...}.
    `target_dir`: the target's folder or hub id the verifier-loaded tensors must equal. Raises FileNotFoundError
    without an interpreter that has speculators."""
    if python is None:
        raise FileNotFoundError(
            "no .venv-speculators: the speculators gate opens the export with speculators' own "
            f"SpeculatorModel.from_pretrained (speculators=={SPECULATORS_PACKAGE}); run `make speculators-env` or "
            "pass python=."
        )
    report = run_engine_side("speculators_load.py", [str(folder), "--target", str(target_dir)], python)
    ids, trained = report.get("target_layer_ids"), contract.get("aux_layer_ids")
    if report.get("model_class") and ids != trained:
        report["problems"].append(
            f"speculators reads target layers {ids} (eagle_aux_hidden_state_layer_ids, HF hidden_states indexing), "
            f"the drafter was trained on {trained}."
        )
    return report
