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
    params_from_tree,
    parse_override,
    run_dir,
    stage_sections,
    stage_view,
)
from eagle3lib.params.files import BASE_KEY, deep_merge, read_base, read_mapping

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "params").glob("*.yaml"))
RECIPES = SHIPPED + sorted((ROOT / "tests" / "params").glob("*.yaml"))  # CI's recipes too
# A shipped recipe states what differs from its base in a screenful; exempt: the base of the CPU recipes, and the
# one large GPU recipe (a whole node's target, and its online layouts in words).
MAX_RECIPE_LINES = 30
LONG_RECIPES = {"smollm2-135m-cpu.yaml", "kimi-k2.5-8gpu.yaml"}


def write(tmp_path, text, name="p.yaml"):
    f = tmp_path / name
    f.write_text(text)
    return f


def test_every_recipe_validates_into_its_own_run_folder():
    assert {f.name for f in SHIPPED} >= {"smollm2-135m-cpu.yaml", "llama3.1-8b-gpu.yaml", "kimi-k2.5-8gpu.yaml"}
    names = [load_params(f).run.name for f in RECIPES]
    assert len(set(names)) == len(names), f"two recipes share a run folder: {names}"
    for f in RECIPES:
        assert Path(load_params(f).run.output_root) == ROOT / "outputs", f


def test_kimi_matches_the_seed_run():
    p = load_params(ROOT / "params" / "kimi-k2.5-8gpu.yaml")
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


def test_a_train_token_cut_needs_a_backend_that_extracts_from_this_process(tmp_path):
    f = write(tmp_path, "extract: {backend: sglang_inprocess, max_train_tokens: 600000}\n")
    with pytest.raises(ParamsError, match=r"extract.max_train_tokens cuts the train split in this process.*use hf"):
        load_params(f)
    assert load_params(write(tmp_path, "extract: {max_train_tokens: 600000}\n")).extract.max_train_tokens == 600000


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


def test_a_file_that_is_not_utf8_names_itself_and_its_line(tmp_path):
    f = tmp_path / "latin1.yaml"
    f.write_bytes(b"run: {name: x}\n# caf\xe9\nbench: {max_tokens: 8}\xff\n")
    with pytest.raises(ParamsError, match=r"latin1\.yaml: not UTF-8 text \(byte 0xe9 on line 2\)"):
        load_params(f)


def test_bad_yaml_names_the_file_and_the_line(tmp_path):
    f = write(tmp_path, "run: {name: x}\ntrain:\n  lr: [1e-3\n  ttt_steps: 3\n")
    with pytest.raises(ParamsError, match=rf"{f}: not valid YAML at line \d+, column \d+"):
        load_params(f)
    with pytest.raises(ParamsError, match="expected a mapping of sections at the top level, found list"):
        load_params(write(tmp_path, "- run\n"))


def test_a_recipe_states_what_differs_from_its_base(tmp_path):
    (tmp_path / "data.jsonl").write_text("")
    write(
        tmp_path,
        "run: {name: base, seed: 4}\ndata: {sources: [./data.jsonl], regenerate: {budget_tokens: 64, batch_size: 2}}\n"
        "bench: {depths: [5, 3], concurrency: [1]}\nengine: {env: {A: '1'}}\n",
        "base.yaml",
    )
    f = write(
        tmp_path,
        "base: base.yaml\ndata: {regenerate: {batch_size: 4}}\nbench: {depths: [2]}\nengine: {env: {B: '2'}}\n",
    )
    p = load_params(f)
    assert p.run.name == "p" and p.run.seed == 4  # the base's name stays the base's: its run folder is its own
    assert (p.data.regenerate.budget_tokens, p.data.regenerate.batch_size) == (64, 4)  # mappings merge
    assert p.bench.depths == [2] and p.bench.concurrency == [1]  # lists are replaced whole
    assert p.engine.env == {"A": "1", "B": "2"}
    assert p.data.sources == [str(tmp_path / "data.jsonl")]


def test_a_bases_paths_stay_relative_to_the_base(tmp_path):
    (tmp_path / "shared" / "drafter").mkdir(parents=True)
    write(tmp_path / "shared", "run: {output_root: runs}\ntrain: {init_from: drafter}\n", "base.yaml")
    (tmp_path / "mine").mkdir()
    p = load_params(write(tmp_path / "mine", "base: ../shared/base.yaml\n"))
    assert Path(p.run.output_root) == tmp_path / "shared" / "runs"
    assert Path(p.train.init_from) == tmp_path / "shared" / "drafter"
    assert Path(p.file) == tmp_path / "mine" / "p.yaml"


def test_a_missing_base_a_circle_and_a_base_that_is_no_mapping_are_refused(tmp_path):
    with pytest.raises(ParamsError, match=r"p\.yaml: base: no params file at .*nope\.yaml"):
        load_params(write(tmp_path, "base: nope.yaml\n"))
    write(tmp_path, "base: b.yaml\n", "a.yaml")
    write(tmp_path, "base: a.yaml\n", "b.yaml")
    with pytest.raises(ParamsError, match=r"in a circle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_params(write(tmp_path, "base: a.yaml\n"))
    with pytest.raises(ParamsError, match=r"in a circle: .*self\.yaml -> .*self\.yaml"):
        load_params(write(tmp_path, "base: self.yaml\n", "self.yaml"))
    write(tmp_path, "[1, 2]\n", "list.yaml")
    with pytest.raises(ParamsError, match=r"list\.yaml: expected a mapping of sections at the top level, found list"):
        load_params(write(tmp_path, "base: list.yaml\n"))
    with pytest.raises(ParamsError, match=r"base: expected the path of a params file, got \[1\]"):
        load_params(write(tmp_path, "base: [1]\n"))
    write(tmp_path, "train: {ttt_step: 3}\n", "typo.yaml")
    with pytest.raises(ParamsError, match=r"(?s)on its base .*typo\.yaml.*did you mean 'ttt_steps'"):
        load_params(write(tmp_path, "base: typo.yaml\n"))


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
        [sys.executable, "-m", "eagle3lib", "params", "check", str(ROOT / "tests" / "params" / "ci-online.yaml")],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    # the whole tree: the base's values (ci.yaml's ttt_steps), the recipe's own and the code's defaults
    assert "ttt_steps: 3" in ok.stdout and "source: online" in ok.stdout and "grad_clip: 0.5" in ok.stdout
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
    assert "it reads target, train and run" in msg and "STAGE_SECTIONS['02_train'] in eagle3lib/params/stages.py" in msg
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
    assert full.startswith("the disk is full while writing /runs/t/01_extract/train/shard_3: free space (df -h)")
    assert "permissions" in os_error_text(PermissionError(errno.EACCES, "Permission denied", "/runs"))


# ---- the recipes: each states only what differs from its base, briefly ------------------------------------------


def leaves(tree: dict, prefix: tuple = ()) -> list[tuple]:
    """The key path of every leaf of a tree (a non-empty mapping is descended into)."""
    found = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            found += leaves(value, (*prefix, key))
        else:
            found.append((*prefix, key))
    return found


def without(tree: dict, path: tuple) -> dict:
    node = {k: (dict(v) if isinstance(v, dict) else v) for k, v in tree.items()}
    if len(path) == 1:
        del node[path[0]]
    else:
        node[path[0]] = without(node[path[0]], path[1:])
    return node


def restated(recipe: Path) -> list[str]:
    """The recipe's keys whose removal resolves to the same params: the value is its base's or the code's default."""
    base, _ = read_base(recipe)
    own = {k: v for k, v in read_mapping(recipe).items() if k != BASE_KEY}
    whole = params_from_tree(deep_merge(base, own), recipe).resolved()
    found = []
    for path in leaves(own):
        if path == ("run", "name"):  # a recipe's name is never inherited
            continue
        try:
            same = params_from_tree(deep_merge(base, without(own, path)), recipe).resolved() == whole
        except ParamsError:
            same = False
        if same:
            found.append(".".join(path))
    return found


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda f: str(f.relative_to(ROOT)))
def test_a_recipe_restates_nothing_its_base_or_the_code_already_says(recipe):
    assert not restated(recipe), f"{recipe.name} restates its base's or the code's value: remove {restated(recipe)}"


def test_the_restatement_check_sees_a_restated_value(tmp_path):
    write(tmp_path, "train: {ttt_steps: 3, lr: 2.0e-3}\n", "base.yaml")
    f = write(tmp_path, "base: base.yaml\ntrain: {ttt_steps: 3, lr: 1.0e-3, grad_clip: 0.5}\n")
    assert restated(f) == ["train.ttt_steps", "train.grad_clip"]


@pytest.mark.parametrize("recipe", SHIPPED, ids=lambda f: f.name)
def test_a_shipped_recipe_fits_a_screen(recipe):
    lines = len(recipe.read_text().splitlines())
    if recipe.name in LONG_RECIPES:
        return
    assert lines <= MAX_RECIPE_LINES, f"{recipe.name} has {lines} lines: state only what differs from its base"


def test_the_long_recipes_named_exist():
    assert LONG_RECIPES <= {f.name for f in SHIPPED}
