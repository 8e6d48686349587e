"""The stage notebooks' steps and results in the library (prepare/notebook.py, extract/notebook.py, convert/notebook.py,
train/notebook.py, deploy/notebook.py, speedup/notebook.py), on small real inputs: the embedded target, a
real drafter checkpoint, a real server process."""

import json
import sys
import textwrap

import pytest
import torch
from conftest import need_engine
from sweep_rows import ROWS
from test_export import ckpt  # noqa: F401  (a real drafter checkpoint for the embedded target)

from eagle3lib import engines, run_folder, target
from eagle3lib.convert import layouts
from eagle3lib.convert import notebook as convert_notebook
from eagle3lib.deploy import notebook as deploy_notebook
from eagle3lib.engines import EngineError
from eagle3lib.engines.interpreter import engine_python
from eagle3lib.extract import backends, shards
from eagle3lib.extract import notebook as extract_notebook
from eagle3lib.params import EngineParams, load_params
from eagle3lib.prepare import conversations, regenerate
from eagle3lib.prepare import notebook as prepare_notebook
from eagle3lib.speedup import notebook as speedup_notebook
from eagle3lib.speedup import recommend, sweep
from eagle3lib.train import notebook as train_notebook
from eagle3lib.train.metrics import acceptance_summary


def conv(cid, question, answer):
    return {"id": cid, "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


SPLITS = {
    "train": [conv(f"t{i}", f"Name {i + 2} colours.", "Red, green and blue.") for i in range(3)],
    "val": [conv("v0", "Say hello.", "Hello!")],
    "bench": [conv("b0", "Count to three.", "One, two, three.")],
}


@pytest.fixture
def params(tmp_path, embedded_cache):
    def load(**overrides):
        path = tmp_path / "params" / "t.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(
            f"run: {{name: t, output_root: ../outputs, cache_dir: {embedded_cache[0]}}}\n"
            "target: {dtype: float32}\n"
            "data: {max_seq_len: 64, regenerate: {budget_tokens: 8, max_new_tokens: 4, batch_size: 2}}\n"
            "extract: {batch_tokens: 128, shard_max_tokens: 64, store_dtype: float32, forward_benchmark_batches: 1}\n"
        )
        return load_params(path, overrides)

    return load


# ---------------------------------------------------------------------------------------------- 00, 01 ----


def test_prepare_then_extract_steps_on_the_embedded_target(params, tmp_path):
    p = params(**{"data.regenerate.only_regenerated": True})
    model, tokenizer = prepare_notebook.load_target(p)  # regenerates with hf here: the weights
    assert isinstance(model, torch.nn.Module)
    info, _ = prepare_notebook.load_target(params(**{"data.regenerate.budget_tokens": 0}))
    assert not isinstance(info, torch.nn.Module) and target.num_layers(info.config) == target.num_layers(model.config)
    prep = tmp_path / "00_prepare"

    same, nothing = prepare_notebook.regenerate_splits(
        params(**{"data.regenerate.budget_tokens": 0}), None, None, SPLITS, prep
    )
    assert same is SPLITS and nothing == {"tokens_generated": 0} and not prep.exists()
    splits, regen = prepare_notebook.regenerate_splits(p, model, tokenizer, SPLITS, prep)
    regenerated = regenerate.read_regenerated(prep / "regenerated.jsonl")
    assert 0 < regen["tokens_generated"] and regenerated  # the budget ran out after the first batch
    kept = [c["id"] for name in ("train", "val") for c in splits[name]]
    assert sorted(kept) == sorted(regenerated) and splits["bench"] == SPLITS["bench"]  # only_regenerated
    assert all(c == regenerated[c["id"]] for c in splits["train"])

    splits = {"train": SPLITS["train"], "val": SPLITS["val"], "bench": SPLITS["bench"]}
    stats = prepare_notebook.write_tokens(tokenizer, splits, p.data.max_seq_len, prep)
    for name in ("train", "val"):
        tokens = conversations.load_tokens(prep / f"{name}.safetensors")
        assert stats[name] == {
            "sequences": len(splits[name]),
            "tokens": len(tokens["input_ids"]),
            "loss_tokens": int(tokens["loss_mask"].sum()),
        }
    assert [b["id"] for b in conversations.load_bench_prompts(prep / "bench.jsonl")] == ["b0"]
    aux_ids = target.aux_layer_ids(p.target.aux_layer_ids, target.num_layers(model.config))
    contract = target.make_contract(p.target.name, model, tokenizer, aux_ids, p.target.dtype)
    target.write_contract(prep, contract)
    r = prepare_notebook.result({"conversations": 5}, splits, regen, stats, contract, "/models/t", 1.5)
    assert r["figures"]["splits"] == {"train": 3, "val": 1, "bench": 1}
    assert r["figures"]["target"] == {
        "layers": 30,
        "aux_layer_ids": [2, 15, 27],
        "fingerprint": contract["target_fingerprint"],
        "path": "/models/t",
    }
    assert r["headline"] == {
        "conversations": 5,
        "train tokens": stats["train"]["tokens"],
        "regenerated tokens": regen["tokens_generated"],
    }
    assert r["artifacts"] == ["train.safetensors", "val.safetensors", "bench.jsonl", "eagle3.json"]
    assert all((prep / a).is_file() for a in r["artifacts"])

    # 01_extract from those files, with the hf backend
    setup = backends.setup(p)
    extract_notebook.check_tokens_match(setup["contract"], prep)
    with pytest.raises(ValueError, match="chat_template_hash"):
        extract_notebook.check_tokens_match(setup["contract"] | {"chat_template_hash": "another template"}, prep)
    out = tmp_path / "01_extract"
    capture = backends.make_capture(p, setup, log_dir=out)
    results = extract_notebook.extract_splits(p, setup, capture, prep, out)
    assert {s: r["total_sequences"] for s, r in results.items()} == {"train": 3, "val": 1}
    assert all(shards.ShardSet(out / s).contract["aux_layer_ids"] == [2, 15, 27] for s in results)
    plain, ratio = extract_notebook.capture_over_plain_prefill(p, setup, capture, prep, results, log_dir=out)
    assert plain > 0 and ratio == pytest.approx(results["train"]["tokens_per_s"] / plain)
    assert results["train"]["capture_over_plain_prefill"] == ratio
    extract_notebook.verify(out, results)
    with pytest.raises(shards.ShardError, match="1 sequences read back, expected 2"):
        extract_notebook.verify(out, results | {"val": results["val"] | {"total_sequences": 2}})
    r = extract_notebook.result(results, plain, ratio, setup["aux_ids"], "float32")
    total = sum(x["total_tokens"] for x in results.values())
    assert r["figures"]["tokens"] == total == stats["train"]["tokens"] + stats["val"]["tokens"]
    assert r["figures"]["sequences"] == 4 and r["figures"]["forward_tokens_per_s"] == plain
    assert r["headline"]["tokens"] == total and r["headline"]["vs forward"] == round(ratio, 2)
    assert r["artifacts"] == ["train/manifest.json", "val/manifest.json"]
    assert all((out / a).is_file() for a in r["artifacts"])


def test_extract_plan_in_each_store_dtype_and_when_the_disk_is_short(params):
    contract = {"hidden_size": 576, "aux_layer_ids": [2, 15, 27], "target_fingerprint": "f"}
    bf16 = extract_notebook.plan_text(params(**{"extract.store_dtype": "bfloat16"}), contract, 1_000_000, 10**12)
    fp8 = extract_notebook.plan_text(params(**{"extract.store_dtype": "float8_e4m3fn"}), contract, 1_000_000, 10**12)
    assert "1,000,000 tokens x 4,613 bytes (4 states of 576 in bfloat16) = 4.613 GB" in bf16
    assert "x 2,325 bytes (4 states of 576 in float8_e4m3fn + 4 float32 scales) = 2.325 GB" in fp8
    assert "no capture rate measured yet" in fp8 and "NOT ENOUGH" not in fp8
    short = extract_notebook.plan_text(params(**{"extract.store_dtype": "float8_e4m3fn"}), contract, 1_000_000, 10**9)
    assert "NOT ENOUGH DISK: 1,325,000,000 bytes short" in short


# -------------------------------------------------------------------------------------------------- 02 ----


def test_online_plan_splits_the_devices_and_expects_the_rate_of_the_runs_measured(params, tmp_path):
    contract = {"target_fingerprint": "f"}
    p = params(**{"train.source": "online"})
    assert "no expected rate yet: no capture or training from shards rate" in train_notebook.online_plan_text(
        p, contract
    )
    root = tmp_path / "outputs"
    run_folder.save_result(
        root / "a", "01_extract", {"tokens_per_s": 1500.0, "backend": "hf", "target_fingerprint": "f"}
    )
    run_folder.save_result(
        root / "a", "02_train", {"train_tokens_per_s": 1000.0, "target_fingerprint": "f", "source": "shards"}
    )
    run_folder.save_result(
        root / "b", "02_train", {"train_tokens_per_s": 5.0, "target_fingerprint": "g", "source": "shards"}
    )
    thread = train_notebook.online_plan_text(p, contract)
    assert "placement thread): the capture runs in a thread of each of the 1 training process(es)" in thread
    assert "0 bytes of states on disk; expected ~600 trainer tokens/s (taking turns, 1/(1/c + 1/t)" in thread
    gpus = train_notebook.online_plan_text(
        params(
            **{
                "train.source": "online",
                "train.online_placement": "process",
                "train.nproc_per_node": 3,
                "target.device": "cuda",
            }
        ),
        contract,
    )
    assert "the capture process on cuda:0, 3 trainer(s) on cuda:1..3 (NCCL)" in gpus
    assert "expected ~1,000 trainer tokens/s (side by side, min(c, t)" in gpus
    ray = {"train.source": "online", "train.online_placement": "ray", "train.nproc_per_node": 2}
    ray_gpus = train_notebook.online_plan_text(params(**ray, **{"target.device": "cuda"}), contract)
    assert "placement ray): Ray places a capture actor on a GPU and 2 trainer actor(s) on a GPU each" in ray_gpus
    assert "(side by side, min(c, t)" in ray_gpus
    assert "(taking turns, 1/(1/c + 1/t)" in train_notebook.online_plan_text(params(**ray), contract)
    sglang = params(**{"train.source": "online", "extract.backend": "sglang_inprocess", "target.device": "cuda"})
    text = train_notebook.online_plan_text(sglang, contract)
    assert "SGLang's model runner captures in a thread of the one training process" in text
    assert "no expected rate yet: no capture rate measured" in text  # hf's capture rate is not SGLang's


def test_train_result_and_overview():
    ev = acceptance_summary([0.7, 0.5, 0.4], [0.7, 0.6, 0.5], max_depth=16, positions=20) | {"at_step": 40}
    summary = {
        "steps": 40,
        "tokens": 16000,
        "train_seconds": 80.0,
        "train_tokens_per_s": 200.0,
        "data_wait_s": 1.2,
        "vocab": {"draft_vocab_size": 2048},
        "world_size": 1,
        "drafter_params": 1234,
        "eval": ev,
    }
    assert train_notebook.overview(summary) == {k: v for k, v in summary.items() if k != "eval"}
    r = train_notebook.result(summary)
    assert r["figures"] is summary and r["artifacts"][0] == "drafter/model.safetensors"
    assert r["headline"] == {
        "est. accept len @5": ev["est_accept_len"]["5"],
        "cond_acc[0]": 0.7,
        "train tokens/s": 200.0,
        "tokens": 16000,
    }


# -------------------------------------------------------------------------------------------------- 03 ----


def test_convert_steps_export_gate_and_result(ckpt, params, tmp_path):  # noqa: F811
    folder, _, target_dir = ckpt
    p = params(**{"bench.depths": [2, 4]})
    out = tmp_path / "03_convert"
    exports = convert_notebook.export_all(p, folder, out)
    assert exports == {e: out / e for e in layouts.ENGINES} and all(
        (x / "model.safetensors").is_file() for x in exports.values()
    )
    commands = convert_notebook.launch_commands(target_dir, exports, p.bench.depths)
    assert list(commands) == ["sglang depth 2", "sglang depth 4", "vllm depth 2", "vllm depth 4"]
    assert commands["vllm depth 4"] == " ".join(engines.launch_command("vllm", target_dir, exports["vllm"], 4))
    assert convert_notebook.commands_text(commands).startswith(f"# sglang depth 2\n{commands['sglang depth 2']}\n\n")

    # The gate with this run's engine SGLang: its loader's parameter set is checked here, vLLM's needs .venv-vllm.
    p = params(**{"bench.depths": [2, 4], "engine.name": "sglang"})
    reports, not_checked = convert_notebook.gate(p, exports)
    assert reports["sglang"]["ok"] and set(reports) | set(not_checked) == set(convert_notebook.GATE)
    if engine_python("vllm") is None:
        assert {"vllm", "speculators (vLLM)"} <= set(not_checked) <= {"vllm", "speculators (vLLM)", "speculators"}
    convert_notebook.refuse_failed(reports)
    broken = reports | {
        "vllm": {"ok": False, "counts": {"loaded": 1, "expected": 2}, "problems": ["fc.weight missing"]}
    }
    with pytest.raises(RuntimeError, match="load-back gate failed:\n  vllm: fc.weight missing"):
        convert_notebook.refuse_failed(broken)
    rows = convert_notebook.gate_rows(broken, {"speculators (vLLM)": "no .venv-vllm: run make vllm-env"})
    assert rows[-1] == {"export": "speculators (vLLM)", "passed": "not checked: no .venv-vllm"}
    assert {"export": "vllm", "passed": False, "loaded": 1, "expected": 2, "problems": 1} in rows

    r = convert_notebook.result(exports, reports, not_checked, commands)
    counts = reports["sglang"]["counts"]
    assert r["headline"]["sglang"] == f"{counts['loaded']}/{counts['expected']} loaded"
    assert (
        r["figures"]["exports"] == {e: str(x) for e, x in exports.items()}
        and r["figures"]["launch_commands"] == commands
    )
    assert r["artifacts"] == [f"{e}/model.safetensors" for e in layouts.ENGINES]


def test_gate_always_checks_the_runs_engine(ckpt, params, tmp_path):  # noqa: F811
    exports = convert_notebook.export_all(params(), ckpt[0], tmp_path)
    p = params(**{"engine.name": "vllm", "engine.python": str(tmp_path / "no-python")})
    with pytest.raises(FileNotFoundError):
        convert_notebook.gate(p, exports)


# -------------------------------------------------------------------------------------------------- 04 ----

HEALTHY = textwrap.dedent(
    """
    import sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Healthy(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

    HTTPServer((sys.argv[sys.argv.index("--host") + 1], int(sys.argv[sys.argv.index("--port") + 1])), Healthy).serve_forever()
    """
)


def test_deploy_checks_the_group_is_gone_and_records_the_server(tmp_path):
    script = tmp_path / "healthy.py"
    script.write_text(HEALTHY)
    server = engines.Server([sys.executable, str(script)], tmp_path / "engine-depth3.log", start_timeout_s=60)
    with server:
        with pytest.raises(RuntimeError, match=r"survived stop\(\); expected none. Kill them: kill \d+"):
            deploy_notebook.check_stopped(server)  # still serving
        served_by = engines.process_starts(engines.group_members(server.group))
    assert deploy_notebook.check_stopped(server) == []
    smoke = {
        "completion_tokens": 32,
        "tokens_per_s": 12.345,
        "tpot_ms": 81.0,
        "accept_len": 2.3456,
        "per_pos": [0.8, 0.5],
        "drafts": 10,
        "outputs": [{"id": "b0", "text": "One, two"}],
    }
    r = deploy_notebook.result(server, smoke, "vllm", 3, None, [], served_by)
    assert r["figures"]["group"] == server.group and str(server.group) in r["figures"]["served_by"]
    assert r["figures"]["log"] == "engine-depth3.log" and r["figures"]["logs"] == ["engine-depth3.log"]
    assert r["figures"]["command"] == server.command and r["figures"]["url"] == server.url
    assert r["figures"]["smoke"] == {k: v for k, v in smoke.items() if k != "outputs"} | {"text": "One, two"}
    assert r["headline"] == {"ready": f"{server.ready_s} s", "smoke tokens/s": 12.3, "acceptance length": 2.346}
    assert r["artifacts"] == ["engine-depth3.log"] and (tmp_path / r["artifacts"][0]).is_file()


# -------------------------------------------------------------------------------------------------- 05 ----


def swept(rows):
    base = {
        "1": [{"id": "a", "token_ids": [1, 2], "text": "ab"}],
        "8": [{"id": "a", "token_ids": [1, 3], "text": "ac"}],
    }
    return {
        "rows": rows,
        "differences": [
            {"id": "a", "first_diff": 1, "baseline": "ab", "speculative": "aX", "depth": 5, "concurrency": 8}
        ],
        "baseline_agreement_across_concurrency": 0.5,
        "baseline_outputs": base,
        "dtype": "float32",
        "restart_per_configuration": True,
        "lossless_reference": "baseline (no speculation) at the same concurrency, dtype float32",
        "seconds": 12.5,
    }


def test_benchmark_texts_and_result():
    rows = [r | {"log": f"vllm-{r['config']}.log"} for r in ROWS]
    s = swept(rows)
    rec = recommend.recommend(rows, "/models/t", {"vllm": "/x/vllm", "sglang": "/x/sglang"})
    assert sweep.lowest_concurrency_baseline(s) == s["baseline_outputs"]["1"]
    text = speedup_notebook.losslessness_text(s)
    assert text.splitlines()[:2] == [
        f"reference: {s['lossless_reference']}",
        "baseline agreement across concurrency: 0.5",
    ]
    assert "- a depth 5 concurrency 8: first different token 1\n    baseline:    'ab'\n    speculative: 'aX'" in text
    assert speedup_notebook.losslessness_text(s | {"differences": []}).endswith(
        "equals the baseline's, token for token"
    )
    text = speedup_notebook.recommendation_text(rec)
    assert text.startswith("concurrency 1: depth5 at 56.0 tokens/s (2.0x the baseline)\n  vLLM:   ")
    assert "concurrency 8: baseline" in text and text.count("SGLang: ") == 2

    replayed = {"target_dtype": "float32", "summary": {"5": {"accept_len": 2.3456}}}
    r = speedup_notebook.result(s, rec, replayed, 4, 32)
    assert r["headline"] == {
        "best speedup": "2.00x (depth5, concurrency 1)",
        "acceptance length": 2.4,
        "replay acceptance": 2.35,
        "lossless": "75% (fp32, token for token)",
    }
    f = r["figures"]
    assert f["rows"] is rows and f["recommendation"] is rec and f["differences"] == s["differences"]
    assert f["sweep_seconds"] == 12.5 and f["prompts"] == 4 and f["max_tokens"] == 32
    assert f["logs"] == ["vllm-baseline.log", "vllm-depth5.log"] and f["replay"] == replayed
    assert r["artifacts"][-1] == "provenance.json"
    baseline_only = speedup_notebook.result(swept(rows[:1]), {}, replayed, 4, 32)["headline"]
    assert baseline_only["best speedup"] is None and baseline_only["lossless"] == "100% (fp32, token for token)"
    # in bf16 the bar is the baseline's own agreement across batch sizes, and the headline says so
    bf16 = speedup_notebook.lossless_headline(s | {"dtype": "bfloat16", "baseline_agreement_across_concurrency": 0.42})
    assert bf16 == "75%, as exact as the baseline across batch sizes (42%); fp32 checks it token for token"
    assert speedup_notebook.losslessness_text(s).splitlines()[2] == "headline: 75% (fp32, token for token)"
    sized = {"prompts": 12, "asked": 26, "asked_estimate_s": 1176.0, "seconds_left": 720.0, "text": "sized to 12"}
    r = speedup_notebook.result(s | {"sizing": sized}, rec, replayed, 12, 32)
    assert r["headline"]["prompts (run.minutes)"] == "12 of 26: all would take ~20 min here, 12 were left"
    assert r["figures"]["sizing"] == sized
    every = speedup_notebook.result(s | {"sizing": sized | {"prompts": 26}}, rec, replayed, 26, 32)
    assert "prompts (run.minutes)" not in every["headline"]


def test_preflight_resolves_sglangs_flags_only(ckpt, params, tmp_path):  # noqa: F811
    sweep.preflight(EngineParams(name="vllm"), "/no/target", "/no/drafter", [3])  # vLLM: nothing to resolve
    need_engine("sglang")
    folder, _, target_dir = ckpt
    export = convert_notebook.export_all(params(), folder, tmp_path)["sglang"]
    sweep.preflight(EngineParams(name="sglang"), target_dir, export, [2, 4])
    contract = json.loads((export / "eagle3.json").read_text())
    (export / "eagle3.json").write_text(json.dumps(contract | {"aux_layer_ids": [3, 15, 27]}))
    with pytest.raises(EngineError, match=r"trained on \[3, 15, 27\]"):
        sweep.preflight(EngineParams(name="sglang"), target_dir, export, [2])
