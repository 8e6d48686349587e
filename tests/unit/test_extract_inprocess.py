"""The sglang_inprocess backend's CPU parts: the shard buffers and extract_with through its Capture (with
the hf target standing in for SGLang's model runner, which needs a GPU), the interfaces it calls in SGLang 0.5.17's
own code (.venv-sglang), the notebook's handle and its failure. The GPU check is tests/gpu/test_extraction_backends.py
and `python -m benchmarks capture` (its results in benchmarks/results/capture/)."""

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_extract import random_tokens, tiny_model

from eagle3lib import params as P
from eagle3lib.engines.interpreter import engine_env
from eagle3lib.extract import hf, shards
from eagle3lib.extract import sglang_inprocess as ip
from eagle3lib.extract import sglang_inprocess_extract as ipx

REPO = Path(__file__).resolve().parents[2]
SGLANG_PY = REPO / ".venv-sglang" / "bin" / "python"
AUX = [1, 3, 4]
CONTRACT = {"target": "tiny-random-llama", "hidden_size": 64, "vocab_size": 256, "aux_layer_ids": AUX}


def test_causal_lm_is_the_model_or_its_language_model():
    from types import SimpleNamespace as NS

    llama = NS(logits_processor=object(), model=NS(layers_to_capture=[]))
    assert ip.causal_lm(llama) is llama
    kimi = NS(language_model=llama, model=NS())  # KimiK25ForConditionalGeneration's shape
    assert ip.causal_lm(kimi) is llama
    with pytest.raises(ip.InProcessError, match="SimpleNamespace has no logits_processor.*extract.backend: sglang"):
        ip.causal_lm(NS(model=NS()))


def test_captured_layers_must_be_ours():
    ip.check_captured([2, 15, 27], [2, 15, 27], "LlamaForCausalLM")
    with pytest.raises(ip.InProcessError, match=r"captures layers \[1, 14, 26\].*expected our aux ids \[2, 15, 27\]"):
        ip.check_captured([1, 14, 26], [2, 15, 27], "DeepseekV3ForCausalLM")


class HFStandIn:
    """An Engine with the hf target in SGLang's place: extend() returns the batch's rows in token order, as the
    logits-processor hook hands them over (aux = HF hidden_states[i], final = the normed last state)."""

    start_s = 0.0

    def __init__(self, model):
        self.model, self.calls = model, []

    def extend(self, seqs, capture):
        self.calls.append((len(seqs), capture))
        rows = [hf.capture_hidden_states(self.model, torch.tensor([s]), torch.ones(1, len(s)), AUX) for s in seqs]
        if not capture:
            return None
        return torch.cat([a[0] for a, _ in rows]).to(torch.bfloat16), torch.cat([f[0] for _, f in rows]).to(
            torch.bfloat16
        )


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.parametrize("store_dtype", [torch.bfloat16, shards.FP8])
def test_inprocess_capture_writes_the_shards_hf_writes(model, tmp_path, store_dtype):
    tokens = random_tokens(n_seqs=24, seed=3, max_len=49)
    engine = HFStandIn(model)
    cap = ipx.InProcessCapture(engine, 64, 256, AUX, store_dtype, batch_tokens=100, plain_batches=2)
    assert isinstance(cap, shards.Capture)
    kw = dict(batch_tokens=100, shard_max_tokens=180, progress=False, store_dtype=store_dtype)
    layout = shards.ShardLayout(store_dtype, shard_max_tokens=180, batch_tokens=100)
    r = shards.extract_with(cap, tokens, AUX, tmp_path / "ip", CONTRACT, layout, progress=False)
    assert r["backend"] == "sglang_inprocess" and r["passes"] == 1 and r["plain_prefill_tokens_per_s"] > 0
    assert [c for _, c in engine.calls[:3]] == [False] * 3  # the plain prefill: one batch untimed, two timed
    assert engine.calls[3:] and all(capture for _, capture in engine.calls[3:])
    hf.extract(model, tokens, AUX, tmp_path / "hf", CONTRACT, **kw)
    got, want = list(shards.ShardSet(tmp_path / "ip")), list(shards.ShardSet(tmp_path / "hf"))
    assert len(got) == len(want) == 24
    tol = dict(rtol=0.07, atol=1e-3) if store_dtype == shards.FP8 else dict(rtol=1.6e-2, atol=1e-2)
    for (ids, mask, aux, final), (ids2, mask2, aux2, final2) in zip(got, want):
        assert torch.equal(ids, ids2) and torch.equal(mask, mask2)
        torch.testing.assert_close(aux.float(), aux2.float(), **tol)
        torch.testing.assert_close(final.float(), final2.float(), **tol)


def test_shard_buffers_take_batches_at_their_offsets():
    x = torch.randn(10, 4 * 8)
    buf = ipx.ShardBuffers(10, 8, 3, shards.FP8, pin=False)
    at = 0
    for a, b in ((0, 4), (4, 10)):
        at += buf.put(at, shards.store_states(x[a:b, :24], x[a:b, 24:], 3, shards.FP8))
    assert at == 10
    whole = shards.store_states(x[:, :24], x[:, 24:], 3, shards.FP8)
    for k, v in whole.items():  # the same bits as quantizing the whole shard at once (per token scales)
        assert torch.equal(buf.tensors[k].view(torch.uint8), v.view(torch.uint8)), k


SGLANG_INTERFACES = textwrap.dedent("""
    import ast, inspect, json, sys
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    import sglang, os
    # one_batch imports uvloop (on GPU hosts), so its functions are read from its source here
    src = open(os.path.join(os.path.dirname(sglang.__file__), "benchmark", "one_batch.py")).read()
    fns = {n.name: [a.arg for a in n.args.args] for n in ast.parse(src).body if isinstance(n, ast.FunctionDef)}
    classes = {n.name: [m.name for m in n.body if isinstance(m, ast.FunctionDef)] for n in ast.parse(src).body
               if isinstance(n, ast.ClassDef)}
    def calls(model):
        src = open(os.path.join(os.path.dirname(sglang.__file__), "srt", "models", model + ".py")).read()
        return [ast.unparse(n) for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call)
                and ast.unparse(n.func) == "self.logits_processor"]
    print(json.dumps({"logits_forward": list(inspect.signature(LogitsProcessor.forward).parameters),
                      "broadcast_object": list(inspect.signature(GroupCoordinator.broadcast_object).parameters),
                      "one_batch": fns, "bench_runner": classes.get("_TorchBenchRunner"),
                      "calls": {m: calls(m) for m in ("llama", "deepseek_v2")}}))
""")


@pytest.mark.usefixtures("sglang_engine")
def test_the_sglang_interfaces_it_calls_in_sglang_0_5_17(tmp_path):
    script = tmp_path / "interfaces.py"
    script.write_text(SGLANG_INTERFACES)
    proc = subprocess.run([str(SGLANG_PY), str(script)], capture_output=True, text=True, timeout=600, env=engine_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["one_batch"]["load_model"] == ["server_args", "port_args", "gpu_id", "tp_rank"]
    assert got["one_batch"]["extend"] == ["reqs", "model_runner"]
    assert got["one_batch"]["prepare_synthetic_inputs_for_latency_test"] == ["batch_size", "input_len", "custom_inputs"]
    assert {"__init__", "clear"} <= set(got["bench_runner"])  # load_model's wrapper; Runner takes .torch_runner
    assert got["broadcast_object"][:3] == ["self", "obj", "src"]
    # Llama's and DeepSeek-V2/V3's (Kimi-K2.5's language model) hand their logits processor the final normed state
    # and the aux list, positionally
    for model, found in got["calls"].items():
        assert "self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch, aux_hidden_states)" in [
            c.replace("\n", "").replace("    ", "") for c in found
        ], model

    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None, **kw):
        pass

    assert ["self", "input_ids", "hidden_states", "lm_head", "logits_metadata", "aux_hidden_states"] == got[
        "logits_forward"
    ][:6]
    final, aux = ip.logits_processor_states(forward, ("me", "ids", "H", "head", "fb", ["a"]), {})
    assert (final, aux) == ("H", ["a"])


def test_notebook_handle_runs_the_module_and_fails_with_the_log(tmp_path, embedded_cache):
    params = REPO / "params" / "smollm2-135m-cpu.yaml"
    p = P.load_params(
        params,
        {
            "run.cache_dir": str(embedded_cache[0]),
            "extract.backend": "sglang_inprocess",
            "extract.max_minutes": None,  # the recipe's cut of the train split is made in this process, not SGLang's
            "engine.name": "sglang",
            "engine.python": sys.executable,  # no sglang here: the module's own error must come back
            "engine.extra_args": ["--tp", "2"],
        },
    )
    from eagle3lib.extract import backends
    from eagle3lib.extract import notebook as extract_notebook

    s = backends.setup(p)
    cap = backends.make_capture(p, s, log_dir=tmp_path)
    assert isinstance(cap, ipx.SGLangInProcess) and cap.extra_args == ["--tp", "2"]
    fp8 = dataclasses.replace(cap, store_dtype="float8_e4m3fn", shard_max_tokens=1000)
    a, flags = ipx.parse_args(fp8.args({"train": ("t.safetensors", "out/train")}, "c.json"))
    assert (a.split, a.store_dtype, a.shard_max_tokens, a.aux_layer_ids, flags) == (
        ["train=t.safetensors:out/train"],
        "float8_e4m3fn",
        1000,
        [2, 15, 27],
        ["--tp", "2"],
    )
    prep = tmp_path / "prep"
    prep.mkdir()
    with pytest.raises(ip.InProcessError, match=r"(?s)exited 1 with splits \[\] of \['train', 'val'\].*sglang") as e:
        extract_notebook.extract_splits(p, s, cap, prep, tmp_path / "out")
    assert f"-m {ipx.__name__} --target" in str(e.value)  # the extract command, in that interpreter
    assert "ModuleNotFoundError" in (tmp_path / "sglang-inprocess.log").read_text()  # its stderr is in the log
