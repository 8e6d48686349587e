"""Params: every shipped file validates; mistakes are errors that say what to fix."""

import subprocess
import sys
from pathlib import Path

import pytest

from eagle3lib.params import EMBEDDED_TARGET_LAYERS, ParamsError, load_params, parse_override

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted((ROOT / "params").glob("*.yaml"))


def write(tmp_path, text, name="p.yaml"):
    f = tmp_path / name
    f.write_text(text)
    return f


def test_the_four_shipped_params_files_validate():
    assert {f.name for f in SHIPPED} >= {"tiny.yaml", "ci.yaml", "llama3.1-8b.yaml", "kimi-k2.5.yaml"}
    for f in SHIPPED:
        p = load_params(f)
        assert p.run.name == f.stem
        assert Path(p.run.output_root) == ROOT / "outputs"


def test_kimi_matches_the_seed_run():
    p = load_params(ROOT / "params" / "kimi-k2.5.yaml")
    assert (p.train.ttt_steps, p.train.max_seq_len, p.train.nproc_per_node) == (5, 8192, 4)
    assert p.bench.depths == [16, 10, 5] and p.target.trust_remote_code


def test_unknown_key_names_key_file_and_valid_keys(tmp_path):
    f = write(tmp_path, "run: {name: x}\nextract: {batch_tokns: 10}\n")
    with pytest.raises(ParamsError) as e:
        load_params(f)
    msg = str(e.value)
    assert str(f) in msg and "extract.batch_tokns" in msg
    assert "did you mean 'batch_tokens'" in msg and "shard_max_tokens" in msg


def test_unknown_section_lists_sections(tmp_path):
    with pytest.raises(ParamsError, match=r"unknown key 'trian'.*did you mean 'train'.*valid keys here: run, target"):
        load_params(write(tmp_path, "trian: {}\n"))


def test_wrong_types_and_negative_budgets(tmp_path):
    f = write(tmp_path, "data: {max_seq_len: lots, regenerate: {budget_tokens: -5}}\ntrain: {max_tokens: 0}\n")
    with pytest.raises(ParamsError) as e:
        load_params(f)
    msg = str(e.value)
    assert "3 problem(s)" in msg
    assert "data.max_seq_len" in msg and "data.regenerate.budget_tokens" in msg and "train.max_tokens" in msg


@pytest.mark.parametrize("ids", [[2, 15, 30], [0, 15, 27], [2, 2, 27], [27, 15, 2], [2, 15]])
def test_aux_ids_outside_the_embedded_targets_layers(tmp_path, ids):
    with pytest.raises(ParamsError, match="aux_layer_ids"):
        load_params(write(tmp_path, f"target: {{aux_layer_ids: {ids}}}\n"))


def test_aux_ids_checked_against_declared_layers(tmp_path):
    f = write(tmp_path, "target: {name: org/model, num_layers: 32, aux_layer_ids: [2, 16, 32]}\n")
    with pytest.raises(ParamsError, match=r"valid ids are 1\.\.31"):
        load_params(f)
    f = write(tmp_path, "target: {name: org/model, num_layers: 32, aux_layer_ids: [2, 16, 31]}\n")
    assert load_params(f).target.aux_layer_ids == [2, 16, 31]


def test_embedded_layer_count_cannot_be_contradicted(tmp_path):
    with pytest.raises(ParamsError, match=f"has {EMBEDDED_TARGET_LAYERS} layers"):
        load_params(write(tmp_path, "target: {num_layers: 12}\n"))


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ParamsError, match="params file not found"):
        load_params(tmp_path / "nope.yaml")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(write(tmp_path, "run: [unclosed\n"))


def test_overrides_and_relative_paths(tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text("")
    f = write(tmp_path, "data: {sources: [chats.jsonl, embedded:sharegpt]}\n")
    p = load_params(f, {"extract.batch_tokens": 128, "run.name": "other"})
    assert p.extract.batch_tokens == 128 and p.run.name == "other"
    assert p.data.sources == [str(data), "embedded:sharegpt"]
    assert parse_override("bench.depths=[3, 2]") == ("bench.depths", [3, 2])
    with pytest.raises(ParamsError, match="KEY=VALUE"):
        parse_override("bench.depths")
    with pytest.raises(ParamsError, match="unknown key 'extract.nope'"):
        load_params(f, {"extract.nope": 1})


def test_cli_params_check(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "eagle3lib", "params", "check", str(ROOT / "params" / "ci.yaml")],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert "ttt_steps: 3" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "eagle3lib", "params", "check", str(write(tmp_path, "x: 1\n"))],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "unknown key 'x'" in bad.stderr


def test_a_tiny_targets_folder_resolves_against_the_params_file(tmp_path):
    (tmp_path / "models" / "kimi").mkdir(parents=True)
    p = load_params(write(tmp_path, "run: {name: x}\ntarget: {name: 'tiny:./models/kimi'}\n"))
    assert p.target.name == f"tiny:{tmp_path / 'models' / 'kimi'}"
    hub = load_params(write(tmp_path, "run: {name: x}\ntarget: {name: 'tiny:moonshotai/Kimi-K2.5'}\n"))
    assert hub.target.name == "tiny:moonshotai/Kimi-K2.5"  # a hub id stays one
