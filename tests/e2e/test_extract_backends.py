"""Extraction backends (01_extract): sglang's launch flags, ids and answers against SGLang 0.5.17's own code
(.venv-sglang, CPU); vLLM's extract_hidden_states capture against the hf backend on the embedded SmolLM2
(.venv-vllm, a real vLLM CPU engine); the params field."""

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import FAST_START

from eagle3lib import params as P
from eagle3lib.convert.gate import check_sglang
from eagle3lib.engines import EngineError
from eagle3lib.engines.interpreter import engine_env
from eagle3lib.engines.sglang import SGLang, check_sglang_args, sglang_captured_ids, sglang_config_ids
from eagle3lib.extract import compare, hf, shards
from eagle3lib.extract import sglang as sg
from eagle3lib.extract.sglang_drafter import write_capture_drafter

REPO = Path(__file__).resolve().parents[2]
SGLANG_PY = REPO / ".venv-sglang" / "bin" / "python"
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
needs_sglang = pytest.mark.usefixtures("sglang_engine")  # conftest: a skip here, a failure under CI
needs_vllm = pytest.mark.usefixtures("vllm_engine")
OURS = [2, 15, 27]  # the embedded target's default [2, L//2, L-3], HF hidden_states indexing

# ------------------------------------------------------------------------------------ sglang ----

DEEPSEEK_LIKE = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM"]
LLAMA_LIKE = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
ID_SETS = [[2, 15, 27], [3, 15, 27], [1, 10, 20], [4, 5, 6], [2, 3, 28], [5, 14, 20]]


def test_sglang_id_translation_round_trip():
    assert sglang_config_ids(OURS, "LlamaForCausalLM") == [1, 14, 26]  # ours - 1
    assert sglang_config_ids([2, 30, 58], "DeepseekV3ForCausalLM") == [1, 29, 57]  # SGLang adds 1 back
    assert sglang_config_ids([3, 30, 58], "DeepseekV3ForCausalLM") == [3, 30, 58]  # SGLang keeps them
    with pytest.raises(ValueError, match="cannot capture HF index 1"):
        sglang_config_ids([1, 30, 58], "KimiK25ForConditionalGeneration")
    for arch in LLAMA_LIKE + DEEPSEEK_LIKE:
        for ids in ID_SETS:
            if arch in DEEPSEEK_LIKE and ids[0] == 1:
                continue
            assert sglang_captured_ids(sglang_config_ids(ids, arch), arch, 30) == ids, (arch, ids)
    assert sglang_captured_ids(None, "LlamaForCausalLM", 30) == OURS  # no ids: SGLang's default = ours


REPLAY = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace as NS
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM
    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    from sglang.srt.models.glm4_moe_lite import Glm4MoeLiteForCausalLM
    from sglang.srt.managers.io_struct import GenerateReqInput
    classes = {c.__name__: c for c in (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, DeepseekV2ForCausalLM,
                                       DeepseekV3ForCausalLM, Glm4MoeLiteForCausalLM)}
    cases = json.loads(sys.argv[1])
    out = {"captured": []}
    for arch, ids in cases:     # SGLang's own set_eagle3_layers_to_capture on a bare object
        me = NS(pp_group=NS(is_last_rank=True), config=NS(num_hidden_layers=30), model=NS())
        classes[arch].set_eagle3_layers_to_capture(me, ids)
        out["captured"].append(me.model.layers_to_capture)
    req = GenerateReqInput(**json.loads(sys.argv[2]))
    req.normalize_batch_and_arguments()
    out["request"] = {"batch_size": req.batch_size, "return_hidden_states": req.return_hidden_states,
                      "max_new_tokens": [p["max_new_tokens"] for p in req.sampling_params]}
    print(json.dumps(out))
""")


@needs_sglang
@pytest.mark.slow
def test_sglang_ids_and_request_against_sglang_code(tmp_path):
    """Our config ids, fed to SGLang 0.5.17's own set_eagle3_layers_to_capture, capture exactly our HF ids
    (llama-like: +1; DeepSeek-like: +1 only when the first id is 1); our request body is a valid batch."""
    cases, want = [], []
    for arch in LLAMA_LIKE + DEEPSEEK_LIKE:
        for ids in ID_SETS:
            if not (arch in DEEPSEEK_LIKE and ids[0] == 1):
                cases.append([arch, sglang_config_ids(ids, arch)])
                want.append(ids)
    body = sg.generate_body([[1, 2, 3], [4, 5]], hidden_states=True)
    script = tmp_path / "replay.py"
    script.write_text(REPLAY)
    proc = subprocess.run(
        [str(SGLANG_PY), str(script), json.dumps(cases), json.dumps(body)],
        capture_output=True,
        text=True,
        timeout=600,
        env=engine_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["captured"] == want
    assert out["request"] == {"batch_size": 2, "return_hidden_states": [True, True], "max_new_tokens": [1, 1]}


def test_capture_drafter_binds_in_sglang_loader(embedded_cache, tmp_path):
    target_dir = embedded_cache[1]
    d = write_capture_drafter(target_dir, OURS, tmp_path / "capture")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    report = check_sglang(
        d, {"hidden_size": 576, "vocab_size": 49152, "draft_vocab_size": 256, "num_layers": 30, "aux_layer_ids": OURS}
    )
    assert report["ok"], report["problems"]
    assert report["counts"]["missing"] == 0 and report["counts"]["skipped"] == 0


@needs_sglang
@pytest.mark.slow
def test_sglang_launch_flags_through_sglang_parser(embedded_cache, tmp_path):
    """Both servers' flags resolve in SGLang 0.5.17's prepare_server_args as the backend needs (hidden states
    'full', no radix cache, no chunked prefill, EAGLE3 chain of 1), and its aux-id resolution reads our
    capture drafter's ids: the target captures our HF ids, default and not."""
    target_dir = embedded_cache[1]
    for ours in (OURS, [3, 11, 20]):
        d = write_capture_drafter(target_dir, ours, tmp_path / f"capture-{ours[0]}")
        reports = sg.check_servers(
            target_dir, d, ours, "bfloat16", ["--attention-backend", "triton"], str(SGLANG_PY), device="cpu"
        )
        assert reports["aux"]["captured_hf_layers"] == ours and reports["final"]["captured_hf_layers"] is None
        aux, final = reports["aux"]["resolved"], reports["final"]["resolved"]
        assert reports["aux"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in ours]
        assert aux["speculative_algorithm"] == "EAGLE3" and aux["speculative_num_draft_tokens"] == 2
        assert final["speculative_algorithm"] is None
        for r in (aux, final):
            assert (
                r["return_hidden_states_mode"] == "full"
                and r["disable_radix_cache"]
                and r["chunked_prefill_size"] == -1
            )
            assert r["dtype"] == "bfloat16"
    # a flag SGLang does not know is refused by its parser, and the preflight says so
    with pytest.raises(EngineError, match="refused the flags"):
        sg.check_servers(
            target_dir, d, [3, 11, 20], None, ["--enable-return-aux-hidden-states"], str(SGLANG_PY), device="cpu"
        )


def test_sglang_server_command(embedded_cache, tmp_path):
    cap = sg.SGLangCapture(
        embedded_cache[1], OURS, dtype="bfloat16", python="/opt/py/bin/python3", extra_args=["--tp", "8"]
    )
    assert (cap.hidden_size, cap.vocab_size, cap.num_layers, cap.architecture) == (576, 49152, 30, "LlamaForCausalLM")
    aux = cap._server_for(tmp_path / "capture", tmp_path)
    final = cap._server_for(None, tmp_path)
    assert isinstance(aux, SGLang) and aux.command[:3] == ["/opt/py/bin/python3", "-m", "sglang.launch_server"]
    assert check_sglang_args(aux.base_command) == []  # what SGLang.start() checks before launching
    assert "--speculative-algorithm" not in final.command and "--enable-return-hidden-states" in final.command
    assert aux.command[-4:] == ["--host", "127.0.0.1", "--port", "0"] and "--tp" in aux.command


def _answer(rows):
    return {
        "text": "x",
        "output_ids": [7],
        "meta_info": {"id": "r", "prompt_tokens": len(rows), "completion_tokens": 1, "hidden_states": [rows]},
    }


def test_sglang_answer_decoding():
    rows = torch.randn(5, 6)
    got = sg.decode_hidden_states(_answer(rows.tolist()), 5, 6)
    assert torch.equal(got, rows)  # float32 through JSON: exact
    bf = torch.randn(3, 4).to(torch.bfloat16)
    assert torch.equal(
        sg.decode_hidden_states(json.loads(json.dumps(_answer(bf.float().tolist()))), 3, 4), bf.float()
    )  # bf16 values survive JSON exactly
    with pytest.raises(sg.SGLangExtractError, match=r"shape \(4, 6\), expected \[5, 6\].*radix-cache"):
        sg.decode_hidden_states(_answer(rows[1:].tolist()), 5, 6)
    with pytest.raises(sg.SGLangExtractError, match="aux-style rows"):
        sg.decode_hidden_states(_answer(torch.randn(5, 18).tolist()), 5, 6)
    with pytest.raises(sg.SGLangExtractError, match="no meta_info.hidden_states.*enable-return-hidden-states"):
        sg.decode_hidden_states({"meta_info": {"id": "r"}}, 5, 6)


def test_sglang_staging_round_trip(tmp_path):
    x = torch.randn(7, 4)
    assert sg._read_staged(tmp_path, 3, 5, 4) is None
    sg._stage(tmp_path, 3, 5, x)
    assert torch.equal(sg._read_staged(tmp_path, 3, 5, 4), x)
    assert sg._read_staged(tmp_path, 3, 5, 8) is None  # another hidden size: not ours
    sg._staged_path(tmp_path, 3, 5).write_bytes(b"truncated")
    assert sg._read_staged(tmp_path, 3, 5, 4) is None and not sg._staged_path(tmp_path, 3, 5).exists()


# -------------------------------------------------------------------------------------- vllm ----


@pytest.fixture(scope="module")
def chat_tokens(embedded_target):
    """8 ShareGPT conversations of the embedded data through the target's chat template, at most 192 tokens."""
    from eagle3lib.prepare import conversations, sources

    convs, _ = sources.load_conversations(sources.EMBEDDED_DATA, limit=8)
    return conversations.tokenize_split(embedded_target[1], convs, 192, progress=False)


def test_final_norm_equals_hf(embedded_target):
    """vLLM's id L is the pre-norm state; our final_norm of it is HF's hidden_states[-1], in fp32 and bf16."""
    from eagle3lib.extract.vllm import final_norm

    model = embedded_target[0]
    ids = torch.randint(0, 49152, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        pre = {}
        h = model.model.layers[-1].register_forward_hook(
            lambda m, a, o: pre.setdefault("x", o[0] if isinstance(o, tuple) else o)
        )
        model.model(input_ids=ids)
        h.remove()
        w, eps = model.model.norm.weight, model.config.rms_norm_eps
        assert torch.equal(final_norm(pre["x"], w, eps), hs[-1])
        assert torch.equal(
            final_norm(pre["x"].bfloat16(), w, eps), model.model.norm.to(torch.bfloat16)(pre["x"].bfloat16())
        )
        model.model.norm.float()


@needs_vllm
@pytest.mark.slow
def test_vllm_backend_equals_hf(embedded_target, embedded_cache, chat_tokens, tmp_path):
    """The vllm backend (a real vLLM CPU engine, extract_hidden_states + our CPU connector) writes the same shards
    as the hf backend on the same tokens of the embedded SmolLM2 in fp32: all three aux layers and the final state
    within 1e-5 relative, each aux slot closest to its own HF layer (not a neighbour), equal argmax. Inside
    `with capture:` the engine serves a second call and a repair (a deleted shard is redone, only it); the
    plain-prefill figure is measured; a rerun of the finished folder starts no engine."""
    from eagle3lib.extract.vllm import VLLMCapture
    from eagle3lib.target import make_contract

    model, tokenizer = embedded_target
    contract = make_contract("embedded:smollm2-135m-instruct", model, tokenizer, OURS, "float32")
    kw = dict(batch_tokens=1024, shard_max_tokens=600, store_dtype=torch.float32, progress=False)
    ref = hf.extract(model, chat_tokens, OURS, str(tmp_path / "hf"), contract, **kw)
    layout = shards.ShardLayout(torch.float32, shard_max_tokens=600, batch_tokens=1024)
    cap = VLLMCapture(
        embedded_cache[1],
        OURS,
        dtype="float32",
        python=str(VLLM_PY),
        extra_args=[*FAST_START, "--max-model-len", "1024"],
        log_dir=tmp_path / "logs",
        prefill_benchmark_batches=1,
        batch_tokens=1024,
    )
    with cap:
        got = shards.extract_with(cap, chat_tokens, OURS, str(tmp_path / "vllm"), contract, layout, progress=False)
        first = shards.load_manifest(tmp_path / "vllm")["shards"][0]
        os.remove(tmp_path / "vllm" / first["file"])
        repair = shards.extract_with(cap, chat_tokens, OURS, str(tmp_path / "vllm"), contract, layout, progress=False)
    print(json.dumps({k: v for k, v in got.items() if not isinstance(v, dict)}, default=str))
    assert got["backend"] == "vllm" and got["complete"] and got["tokens"] == chat_tokens["input_ids"].numel()
    assert got["shards"] == ref["shards"] >= 2 and got["bytes"] == ref["bytes"]
    assert got["tokens_per_s"] > 0 and got["plain_prefill_tokens_per_s"] > 0 and got["engine_start_s"] > 0
    assert got["connector"] == "CPUHiddenStatesConnector" and got["engine_dtype"] == "torch.float32"
    assert got["wire_bytes"] == got["tokens"] * 4 * 576 * 4  # (3 aux + pre-norm final) fp32 values
    assert repair["engine_reused"] and repair["sequences"] == first["sequences"] and "engine_start_s" not in repair
    assert not any(p.name.startswith(".vllm-work") for p in tmp_path.iterdir())  # cleaned up on exit
    a, b = shards.load_manifest(tmp_path / "vllm"), shards.load_manifest(tmp_path / "hf")
    assert [(e["file"], e["sequences"], e["tokens"]) for e in a["shards"]] == [
        (e["file"], e["sequences"], e["tokens"]) for e in b["shards"]
    ]
    assert shards.ShardSet(tmp_path / "vllm").contract == contract
    agree = compare.compare_shard_sets(
        tmp_path / "vllm", tmp_path / "hf", lm_head=model.lm_head.weight.detach(), rel_tol=1e-5
    )
    print(json.dumps(agree))
    assert set(agree["layers"]) == {"aux_2", "aux_15", "aux_27", "final"}
    assert agree["ok"] and agree["argmax_agree"] == 1.0, agree
    probe = compare.layer_probe(model, tmp_path / "vllm", OURS, max_sequences=3)
    assert probe["ok"], probe
    for slot in probe["slots"]:  # the neighbours are far: an off-by-one would not hide
        own = slot["rel_rms"][str(slot["want"])]
        assert own < 1e-5 and all(e > 1e3 * own for j, e in slot["rel_rms"].items() if j != str(slot["want"]))
    again = shards.extract_with(cap, chat_tokens, OURS, str(tmp_path / "vllm"), contract, layout, progress=False)
    assert again["tokens"] == 0 and again["tokens_per_s"] is None and "engine_start_s" not in again


# ---------------------------------------------------------------------------------- protocol ----


def test_every_backend_is_a_capture(embedded_cache, embedded_target):
    """extract_with takes any shards.Capture: the three backends have all it names (attributes and methods)."""
    from eagle3lib.extract.vllm import VLLMCapture

    target_dir = embedded_cache[1]
    for cap in (
        hf.HFCapture(embedded_target[0], OURS),
        VLLMCapture(target_dir, OURS, python="/py"),
        sg.SGLangCapture(target_dir, OURS, python="/py"),
    ):
        assert isinstance(cap, shards.Capture), type(cap).__name__
    assert not isinstance(object(), shards.Capture)


# ------------------------------------------------------------------------------------ params ----


def test_backend_param_and_dispatch(embedded_cache, tmp_path):
    from eagle3lib.extract import backends
    from eagle3lib.extract.sglang import SGLangCapture
    from eagle3lib.extract.vllm import VLLMCapture

    params = REPO / "params" / "smollm2-135m-cpu.yaml"
    with pytest.raises(
        P.ParamsError,
        match=r"extract.backend: unknown extraction backend 'vlm'; expected one of: 'hf'.*'vllm'.*'sglang'",
    ):
        P.load_params(params, {"extract.backend": "vlm"})
    assert P.load_params(params).extract.backend == "hf"
    cache = {"run.cache_dir": str(embedded_cache[0])}
    p = P.load_params(
        params, {**cache, "extract.backend": "vllm", "engine.name": "vllm", "engine.extra_args": ["--enforce-eager"]}
    )
    s = backends.setup(p)
    assert s["model"] is None and s["aux_ids"] == OURS and s["target_dir"] == str(embedded_cache[1])
    assert s["contract"]["hidden_size"] == 576 and s["contract"]["aux_layer_ids"] == OURS
    cap = backends.make_capture(p, s, log_dir=tmp_path).capture
    assert isinstance(cap, VLLMCapture) and cap.layers == OURS + [30] and cap.dtype == p.target.dtype
    assert cap.extra_args == ["--enforce-eager", "--max-model-len", str(p.data.max_seq_len + 16)]
    # engine.* belongs to the deploy engine; it applies to the extraction engine only when it is the same one
    p = P.load_params(
        params, {**cache, "extract.backend": "sglang", "engine.name": "vllm", "engine.extra_args": ["--enforce-eager"]}
    )
    cap = backends.make_capture(p, backends.setup(p), log_dir=tmp_path).capture
    assert isinstance(cap, SGLangCapture) and cap.extra_args == [] and cap.num_layers == 30
