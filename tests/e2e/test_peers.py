"""The peers comparison's tools on the CPU: our shards in SpecForge's and speculators' formats hold
the same tokens, mask and states; SpecForge's inputs follow its conventions; served_al.py's figures per drafter.
The peers' training and serving run on the H200 (python -m benchmarks peers)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import need_engine
from safetensors.torch import load_file
from test_train import make_run
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from eagle3lib.engines.interpreter import engine_env
from eagle3lib.extract.shards import ShardSet

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import peer_data, peers  # noqa: E402
from benchmarks.questions import served_al  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory, embedded_cache):
    """A run folder (00_prepare, 01_extract train/val) from a small random Llama, and the target folder."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=256, tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)  # a final norm that is not the identity
    root = tmp_path_factory.mktemp("peers")
    run_dir = make_run(root, model, AutoTokenizer.from_pretrained(embedded_cache[1]), {}, n_train=12)
    return run_dir, root / "target"


def test_specforge_features_are_our_shards(run, tmp_path):
    run_dir, _ = run
    source = peer_data.write_specforge(run_dir / "01_extract", tmp_path / "sf")
    assert source["train"]["sequences"] == 12 and source["val"]["sequences"] == 8
    for split in ("train", "val"):
        for i, (ids, mask, aux, final) in enumerate(ShardSet(run_dir / "01_extract" / split)):
            d = torch.load(tmp_path / "sf" / split / "rows_0-2000" / f"data_{i}.ckpt")
            assert d["input_ids"].dtype == torch.int64 and torch.equal(d["input_ids"], ids.long())
            assert torch.equal(d["loss_mask"], mask.long())
            assert d["hidden_state"].shape == (1, ids.numel(), 64) and d["hidden_state"].dtype == torch.bfloat16
            assert torch.equal(d["aux_hidden_state"][0], aux.to(torch.bfloat16))
            assert torch.equal(d["hidden_state"][0], final.to(torch.bfloat16))
    with pytest.raises(FileExistsError, match="not empty"):
        peer_data.write_specforge(run_dir / "01_extract", tmp_path / "sf")


def test_speculators_folder_keeps_the_split_and_its_norm_gives_back_the_final_state(run, tmp_path):
    """Written in .venv-speculators (it has `datasets`): rows in order with train first, and the stored final
    state through the target's own final norm (as speculators applies it) equals the state we captured."""
    run_dir, target_dir = run
    py = need_engine("speculators")
    out = tmp_path / "spec"
    args = [py, "-m", "benchmarks.peer_data", "speculators", str(run_dir / "01_extract"), str(out)]
    proc = subprocess.run(args + ["--target", str(target_dir)], capture_output=True, text=True, timeout=600,
                          env=engine_env(pythonpath=[str(ROOT)]))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    source = json.loads((out / "source.json").read_text())
    assert source["train_data_ratio"] == 12 / 20
    model = LlamaForCausalLM.from_pretrained(target_dir).eval()
    rows = [s for split in ("train", "val") for s in ShardSet(run_dir / "01_extract" / split)]
    for i in (0, 11, 12, 19):
        ids, _, aux, final = rows[i]
        hs = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        assert torch.equal(hs["token_ids"], ids.long()) and hs["hidden_states"].shape == (ids.numel(), 4, 64)
        assert torch.equal(hs["hidden_states"][:, :3].reshape(ids.numel(), -1), aux.to(torch.bfloat16))
        with torch.no_grad():
            again = model.model.norm(hs["hidden_states"][:, 3].float())
        assert (again - final.float()).abs().max() <= 0.02 * final.abs().max()  # bf16 storage
    freq = torch.load(out / "token_freq.pt")
    masked = sum(int(m.sum()) for _, m, _, _ in rows[:12])
    assert sum(freq.values()) == masked  # train rows' loss-masked tokens only


def test_specforge_inputs_follow_its_conventions(run, tmp_path):
    run_dir, target_dir = run
    peer_data.write_specforge(run_dir / "01_extract", tmp_path / "sf")
    assert peers.specforge_setup([str(target_dir), str(tmp_path / "sf"), str(tmp_path / "w"), "--draft-vocab", "96",
                                  "--epochs", "2"]) == 0  # fmt: skip
    draft = json.loads((tmp_path / "w" / "draft.json").read_text())
    assert draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]  # SGLang ids = HF [1, 3, 5] - 1
    assert draft["draft_vocab_size"] == 96 and draft["num_hidden_layers"] == 1 and draft["hidden_size"] == 64
    index = json.loads((tmp_path / "w" / "target" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" in index["weight_map"]
    import yaml

    run_yaml = yaml.safe_load((tmp_path / "w" / "run.yaml").read_text())
    assert run_yaml["model"]["lm_head_key"] == "lm_head.weight"  # untied target
    assert run_yaml["training"]["learning_rate"] == 1e-4 and run_yaml["training"]["ttt_length"] == 7
    assert run_yaml["data"]["eval_hidden_states_path"].endswith("val")


def test_offline_al_is_the_drafters_not_its_layouts(run, tmp_path):
    """served_al.py --offline-only: our trainer's validation of each drafter, whatever layout it comes in; one
    drafter as our checkpoint and as its speculators export gets the same AL, another drafter another."""
    from eagle3lib.convert import layouts
    from eagle3lib.params import load_params
    from eagle3lib.train.runtime.checkpoint import save_drafter
    from eagle3lib.train.runtime.setup import build_setup

    run_dir, target_dir = run
    params = str(run_dir.parent.parent / "params.yaml")
    setup, _ = build_setup(load_params(params), run_dir)
    folders = {}
    for seed in (1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():
            for param in setup.drafter.parameters():
                param.add_(torch.randn_like(param) * 0.5)
        folders[seed] = save_drafter(setup.drafter, tmp_path / f"d{seed}", setup.contract)
    spec = layouts.export(folders[1], "speculators", tmp_path / "d1-speculators", target=str(target_dir))
    out = tmp_path / "offline.json"
    argv = [str(run_dir), "--params", params, "--drafter", f"ours={folders[1]}", "--drafter", f"speculators={spec}",
            "--drafter", f"other={folders[2]}", "--depths", "2,3", "--offline-only", "--out", str(out)]  # fmt: skip
    assert served_al.main(argv) == 0
    al = {(r["trainer"], r["depth"]): r["offline_al"] for r in json.loads(out.read_text())["rows"]}
    assert al[("ours", 3)] == al[("speculators", 3)] and al[("ours", 2)] == al[("speculators", 2)]
    assert al[("ours", 3)] != al[("other", 3)] and all(1.0 <= v <= 4.0 for v in al.values())


def test_served_al_rows_and_means():
    assert served_al.named(["ours=/a", "specforge:our-hparams=/b"], "drafter") == {
        "ours": "/a",
        "specforge:our-hparams": "/b",
    }
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        served_al.named(["ours"], "drafter")
    assert served_al.parse_name("ours:muon:2") == {"trainer": "ours", "config": "muon", "seed": 2}
    assert served_al.parse_name("speculators") == {"trainer": "speculators", "config": "defaults", "seed": None}
    with pytest.raises(SystemExit, match="integer SEED"):
        served_al.parse_name("ours:muon:two")
    assert served_al.engine_args(["--x", "1", "--mem-fraction-static", "0.3"], 0.1) == [
        "--x",
        "1",
        "--mem-fraction-static",
        "0.1",
    ]

    def part(accepted, verify, tokens):
        return [{"spec_verify_ct": verify, "spec_num_correct_drafts": accepted, "completion_tokens": tokens}]

    results = {
        ("ours", 3): {"mt_bench": {"parts": [part(10, 20, 30)], "outputs": [{"completion_tokens": 30}],
                                   "requests": [{"id": "q1", "completion_tokens": 30, "parts": [part(10, 20, 30)]}]},
                      "gsm8k": {"parts": [part(20, 20, 40)], "outputs": [{"completion_tokens": 40}]}},
    }  # fmt: skip
    offline = {"ours": {"accept_len_at": {3: 1.4, 5: 1.5}}, "speculators": {"accept_len_at": {3: 1.7, 5: 1.8}}}
    predicted = {"ours": {"mt_bench": {3: 1.45}}}
    rows = served_al.rows_of(results, predicted, offline, [3, 5], {"ours": {"gpu_s": 9}}, "sglang")
    served = {(r["trainer"], r["set"]): r for r in rows if r["set"] != "val"}
    assert served[("ours", "mt_bench")]["served_al"] == 1.5 and served[("ours", "mt_bench")]["predicted_al"] == 1.45
    assert served[("ours", "gsm8k")]["served_al"] == 2.0 and served[("ours", "gsm8k")]["gpu_s"] == 9
    assert served[("ours", "mt_bench")]["per_prompt"] == [["q1", 30, 1.5]] and served[("ours", "gsm8k")]["prompts"] == 1
    assert served[("ours", "gsm8k")]["budget"] == "tokens" and served[("ours", "gsm8k")]["seed"] is None
    assert {(r["trainer"], r["depth"], r["offline_al"]) for r in rows if r["set"] == "val"} == {
        ("ours", 3, 1.4), ("ours", 5, 1.5), ("speculators", 3, 1.7), ("speculators", 5, 1.8)}  # fmt: skip
    (mean,) = served_al.mean_over_sets(rows)
    assert mean["trainer"] == "ours" and mean["served_al_mean"] == 1.75 and mean["sets"] == 2


def test_launched_jobs_take_the_gpus_in_turn_and_wait_records_each_exit(tmp_path):
    """peers.sh's launch gives job i the i-th of GPUS (modulo their number) through CUDA_VISIBLE_DEVICES, as its
    job sees it; wait collects every job's exit. The jobs are trainers' steps that stop at once here (no data)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "sharegpt-7000.json.xz").write_bytes(b"")  # the cut is there: the script does not make it
    jobs = ["ours:defaults:0", "speculators:sglang:0", "ours:defaults:1"]
    env = dict(os.environ, GPUS="3,5", JOBS=" ".join(jobs), DATA_DIR=str(data), WAIT_S="120")
    work, raw = tmp_path / "work", tmp_path / "raw"
    plan = [sys.executable, "-m", "benchmarks", "--out", str(tmp_path / "results"), "peers", "gpu-plan"]
    where = ["--work", str(work), "--raw", str(raw)]
    launched = subprocess.run([*plan, "launch", *where], cwd=ROOT, env=env, capture_output=True, text=True)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert [line for line in launched.stdout.splitlines() if line.startswith("launched")] == [
        "launched ours:defaults:0 on GPU 3", "launched speculators:sglang:0 on GPU 5", "launched ours:defaults:1 on GPU 3"
    ]  # fmt: skip
    waited = subprocess.run([*plan, "wait", *where], cwd=ROOT, env=env, capture_output=True, text=True)
    assert waited.returncode == 0 and "still running" not in waited.stdout, waited.stdout + waited.stderr
    seen = {f.stem: f.read_text().strip() for f in (work / "jobs").glob("*.gpu")}
    assert seen == {"ours-defaults-s0": "CUDA_VISIBLE_DEVICES=3", "speculators-sglang-s0": "CUDA_VISIBLE_DEVICES=5",
                    "ours-defaults-s1": "CUDA_VISIBLE_DEVICES=3"}  # fmt: skip
    exits = {f.stem: f.read_text().strip() for f in (work / "jobs").glob("*.done")}
    assert set(exits) == set(seen) and all(rc.startswith("rc ") and rc != "rc 0" for rc in exits.values())
    assert (raw / "train-records.tgz").is_file()
