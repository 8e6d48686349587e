"""Params: every shipped file validates; mistakes are errors that say what to fix."""

import copy
import errno
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3lib.params import (
    EMBEDDED_TARGET_LAYERS,
    Params,
    ParamsError,
    UnreadSectionError,
    cache_dir,
    load_params,
    parse_override,
    run_dir,
    stage_sections,
    stage_view,
)

ROOT = Path(__file__).resolve().parents[2]
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


# ---- what each stage reads: stage_sections per choice, and the view that holds a stage to them ----------------

SECTION_CHOICES = [
    # (overrides, stage, the sections it reads)
    ({}, "00_prepare", ["target", "data"]),
    ({"data.regenerate.budget_tokens": 64}, "00_prepare", ["target", "data"]),  # hf: this process generates
    (
        {"data.regenerate.budget_tokens": 64, "data.regenerate.backend": "engine"},
        "00_prepare",
        ["target", "data", "engine"],
    ),
    ({"data.regenerate.backend": "engine"}, "00_prepare", ["target", "data"]),  # no budget: nothing is regenerated
    ({}, "01_extract", ["target", "extract"]),
    ({"extract.backend": "vllm"}, "01_extract", ["target", "extract", "engine", "data"]),
    ({"extract.backend": "sglang"}, "01_extract", ["target", "extract", "engine"]),
    ({"extract.backend": "sglang_inprocess"}, "01_extract", ["target", "extract", "engine"]),
    ({}, "02_train", ["target", "train"]),
    ({"extract.backend": "sglang_inprocess"}, "02_train", ["target", "train"]),  # from shards: no capture
    ({"train.source": "online"}, "02_train", ["target", "train", "extract"]),
    ({"train.source": "online", "train.online_placement": "process"}, "02_train", ["target", "train", "extract"]),
    (
        {"train.source": "online", "extract.backend": "sglang_inprocess"},
        "02_train",
        ["target", "train", "extract", "engine"],
    ),
    ({}, "03_convert", ["target", "engine", "bench"]),
    ({}, "04_deploy", ["target", "engine", "bench"]),
    ({}, "05_benchmark", ["target", "engine", "bench"]),
]


@pytest.mark.parametrize(("overrides", "stage", "sections"), SECTION_CHOICES)
def test_stage_sections_follow_the_params_choices(tmp_path, overrides, stage, sections):
    p = load_params(write(tmp_path, "run: {name: x}\n"), overrides)
    assert stage_sections(stage, p) == sections
    # the choices lie in sections the stage then reads, so Stage.save finds the same through the view
    assert stage_sections(stage, stage_view(p, stage)) == sections


def test_a_stage_not_listed_reads_every_section(tmp_path):
    p = load_params(write(tmp_path, "run: {name: x}\n"))
    assert stage_sections("06_extra", p) == Params.section_names()
    assert stage_view(p, "06_extra") is p


def test_the_view_refuses_a_section_the_stage_does_not_read(tmp_path):
    p = load_params(write(tmp_path, "run: {name: x}\n"))
    view = stage_view(p, "02_train")
    with pytest.raises(UnreadSectionError) as e:
        _ = view.bench.depths
    msg = str(e.value)
    assert "02_train read params bench.depths" in msg and "does not read the bench section" in msg
    assert "it reads target, train and run" in msg and "STAGE_SECTIONS['02_train'] in eagle3lib/params.py" in msg
    # a section read only under another choice says which
    with pytest.raises(UnreadSectionError, match=r"reads extract only when train.source is online, not with these"):
        _ = view.extract.backend
    with pytest.raises(UnreadSectionError, match="02_train set params engine.name"):
        view.engine.name = "sglang"
    # not an AttributeError: probing is reading, and no default hides it
    with pytest.raises(UnreadSectionError):
        hasattr(view.data, "max_seq_len")
    with pytest.raises(UnreadSectionError):
        getattr(view.data, "max_seq_len", 2048)
    assert p.bench.depths == [16, 10, 5] and p.engine.name == "vllm"  # the full params are untouched


def test_the_view_reads_the_stages_sections_and_the_bookkeeping(tmp_path):
    f = write(tmp_path, "run: {name: x, seed: 3, cache_dir: cache}\ntrain: {lr: 2.0e-3, dtype: auto}\n")
    p = load_params(f, {"train.max_tokens": 500})
    view = stage_view(p, "02_train")
    assert (view.train.lr, view.train.max_tokens, view.target.name) == (2e-3, 500, p.target.name)
    assert (view.run.seed, view.run.name) == (3, "x")
    assert cache_dir(view) == tmp_path / "cache" and run_dir(view) == run_dir(p)
    assert view.file == str(f) and "train.dtype" in view.dtype_choices
    bookkeeping = [name for name, field in Params.model_fields.items() if field.exclude]  # file, overrides, ...
    assert all(getattr(view, name) == getattr(p, name) for name in bookkeeping)
    # an unread section may be passed around, shown, copied and pickled: only reading it raises
    bench = view.bench
    assert "not read by 02_train" in repr(bench) and "not read by 02_train" in repr(view)
    for copied in (copy.deepcopy(view), pickle.loads(pickle.dumps(view))):
        assert copied.train.lr == 2e-3
        with pytest.raises(UnreadSectionError, match="02_train read params bench.depths"):
            _ = copied.bench.depths


def test_00_prepare_prints_later_stages_plans_from_the_whole_params_and_hashes_only_its_own(tmp_path):
    """00_prepare prints 01_extract's disk plan and online mode's plan from stage.all_params (every section, for text about
    later stages); its own view refuses extract and train, which are not in its hash."""
    from eagle3lib.extract import notebook as extract_notebook
    from eagle3lib.train import notebook as train_notebook
    from eagle3lib.workbook.stage import open_stage

    params = write(tmp_path, "run: {name: x, output_root: out}\n")
    stage = open_stage("00_prepare", params, tmp_path / "run", {"extract.store_dtype": "float16"})
    contract = {"hidden_size": 8, "aux_layer_ids": [1, 2, 3], "target_fingerprint": "f"}
    assert "in float16" in extract_notebook.plan_text(stage.all_params, contract, 10, free_bytes=10**9)
    assert "02_train online plan (with train.source: online, placement thread)" in train_notebook.online_plan_text(
        stage.all_params, contract
    )
    with pytest.raises(UnreadSectionError, match="00_prepare read params extract.store_dtype"):
        extract_notebook.plan_text(stage.p, contract, 10, free_bytes=10**9)
    with pytest.raises(UnreadSectionError, match="00_prepare read params train.lr"):
        _ = stage.p.train.lr
    assert stage_sections("00_prepare", stage.all_params) == ["target", "data"]


def test_an_override_that_is_not_yaml_names_its_key():
    with pytest.raises(ParamsError, match=r"train.lr is not valid YAML .*quote it"):
        parse_override("train.lr=[1,")


def test_os_errors_say_what_to_do():
    from eagle3lib.__main__ import os_error_text

    full = os_error_text(OSError(errno.ENOSPC, "No space left on device", "/runs/t/01_extract/train/shard_3"))
    assert full.startswith("/runs/t/01_extract/train/shard_3: No space left on device") and "disk is full" in full
    assert "permissions" in os_error_text(PermissionError(errno.EACCES, "Permission denied", "/runs"))
