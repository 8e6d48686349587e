"""Engine servers: the real vLLM CPU server on 127.0.0.1 (.venv-vllm), SGLang up to the launch.

A real drafter export for the embedded SmolLM2: a tiny drafter that has learned one prompt's greedy continuation
(conftest's `learned`), so the engine accepts its drafts there only if it feeds the drafter the right aux states.
No process may outlive a test: every test that starts a server checks its process group is empty.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import FAST_START, need_engine
from drafters import MAX_TOKENS

from eagle3lib import engines
from eagle3lib.convert import layouts as ex
from eagle3lib.drafter.vocab import d2t_sha256
from eagle3lib.engines import EngineError, alive_in_group
from eagle3lib.engines.interpreter import REPO, InterpreterError, engine_env, module_env, run_engine_side, run_module
from eagle3lib.engines.sglang import check_sglang_args, sglang_launch_args
from eagle3lib.engines.vllm import vllm_launch_args
from eagle3lib.params import EngineParams
from eagle3lib.target import EMBEDDED_TARGET, make_contract
from eagle3lib.train.runtime.checkpoint import save_drafter

need = need_engine
AUX = [2, 15, 27]  # the embedded target's default aux ids (SmolLM2: 30 layers)


def fast(**kw) -> EngineParams:
    return EngineParams(extra_args=FAST_START, **kw)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, embedded_cache, embedded_target, learned):
    """{engine: export folder} of the learned tiny drafter for the embedded target, plus 'target'."""
    cache, target_dir = embedded_cache
    model, tokenizer = embedded_target
    drafter = learned["drafter"]
    assert drafter.cfg.aux_layer_ids == AUX
    contract = make_contract(EMBEDDED_TARGET, model, tokenizer, drafter.cfg.aux_layer_ids, "float32")
    contract.update(draft_vocab_size=drafter.cfg.draft_vocab_size, d2t_sha256=d2t_sha256(drafter.d2t))
    ckpt = save_drafter(drafter, tmp_path_factory.mktemp("ckpt") / "drafter", contract)
    out = tmp_path_factory.mktemp("exports")
    found = {e: ex.export(ckpt, e, out / e, target=EMBEDDED_TARGET, cache_dir=cache) for e in ("vllm", "sglang")}
    return found | {"target": target_dir}


def prompt(tokenizer, text="Name three colors."):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ------------------------------------------------------------------------ no server ----


def test_commands_and_logs(tmp_path):
    s = engines.make(EngineParams(name="vllm", env={"VLLM_CPU_KVCACHE_SPACE": "2"}), "/t", "/d", 5, tmp_path)
    assert s.base_command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    spec = json.loads(s.base_command[s.base_command.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 5, "use_local_argmax_reduction": True}
    env = engine_env(s.env)  # what start() runs it with: engine.env over the engines' defaults
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["HF_HUB_OFFLINE"] == "1" and env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert s.log_path == tmp_path / "vllm-depth5.log"
    base = engines.make(EngineParams(), "/t", "/d", None, tmp_path, dtype="float32")
    assert "--speculative-config" not in base.base_command and base.base_command[-2:] == ["--dtype", "float32"]
    assert base.log_path.name == "vllm-baseline-float32.log"
    g = engines.make(EngineParams(name="sglang", python="/gpu/env/bin/python"), "/t", "/d", 4, tmp_path)
    assert g.base_command[:5] == ["/gpu/env/bin/python", "-m", "sglang.launch_server", "--model-path", "/t"]
    assert g.base_command[5:] == sglang_launch_args("/d", 4)
    assert g.command[-4:-2] == ["--host", "127.0.0.1"]


def test_engine_env_and_inside_runner(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    monkeypatch.setenv("PYTHONPATH", "/a")
    env = engine_env({"TOKENIZERS_PARALLELISM": "true"}, pythonpath=["/inside"])
    assert env["HF_HUB_OFFLINE"] == "1"  # ours over the environment's: engines never reach the hub
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "8"  # a size: the environment's when it says
    assert env["TOKENIZERS_PARALLELISM"] == "true"  # engine.env over ours
    assert env["PYTHONPATH"] == os.pathsep.join(["/inside", "/a"])
    with pytest.raises(InterpreterError, match=r"(?s)no_such_script.py.*failed \(exit 2\); expected a JSON report"):
        run_engine_side("no_such_script.py", [], sys.executable)


MODULE_RUN = """
import sys
for i in range(50):
    print(f"out {i}", flush=True)
print("err line", file=sys.stderr, flush=True)
sys.exit(int(sys.argv[1]))
"""


def test_module_run_in_an_engines_interpreter(monkeypatch, tmp_path):
    """run_module: stdout and stderr as one stream, every line to the log and to the handler; a failure names the
    command and exit status and brings the log's last 40 lines; the environment puts this eagle3lib first."""
    monkeypatch.setenv("PYTHONPATH", "/a")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    env = module_env({"EXTRA": "1"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/a"] and env["EXTRA"] == "1"
    assert env["HF_HUB_OFFLINE"] == "0"  # the stage's own environment, not the engines' ENGINE_ENV
    (tmp_path / "mod_run.py").write_text(MODULE_RUN)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    seen, log = [], tmp_path / "logs" / "run.log"
    run_module(sys.executable, "mod_run", ["0"], log, env=env, on_line=seen.append)
    assert seen[0] == "out 0\n" and seen[-1] == "err line\n" and len(seen) == 51
    assert log.read_text() == "".join(seen)
    with pytest.raises(InterpreterError, match=r"(?s)`.* -m mod_run` exited 3; command: .* -m mod_run 3\n") as e:
        run_module(sys.executable, "mod_run", ["3"], log, env=env, on_line=seen.append)
    assert str(e.value).endswith("".join(f"out {i}\n" for i in range(11, 50)) + "err line\n")
    assert "out 10\n" not in str(e.value)

    class Refused(RuntimeError):
        pass

    with pytest.raises(Refused, match=r"^made nothing \(exit 0\); command: "):
        run_module(
            sys.executable,
            "mod_run",
            ["0"],
            log,
            env=env,
            on_line=seen.append,
            finished=lambda: False,
            failure=lambda code: f"made nothing (exit {code})",
            error=Refused,
        )


def test_launch_flags():
    assert sglang_launch_args("/d", 5) == [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        "/d",
        "--speculative-num-steps",
        "5",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "6",
    ]
    flag, spec = vllm_launch_args("/d", 5)
    assert flag == "--speculative-config"
    assert json.loads(spec) == {
        "method": "eagle3", "model": "/d", "num_speculative_tokens": 5, "use_local_argmax_reduction": True
    }  # fmt: skip
    assert check_sglang_args(sglang_launch_args("/d", 5)) == []
    eagle = sglang_launch_args("/d", 5)
    eagle[1] = "EAGLE"
    assert any("'EAGLE3'" in p and "acceptance 1.00" in p for p in check_sglang_args(eagle))

    cmd = engines.launch_command("sglang", "/t", "/d", 5, "/py")
    assert cmd == ["/py", "-m", "sglang.launch_server", "--model-path", "/t"] + sglang_launch_args("/d", 5)
    assert engines.launch_command("vllm", "/t", "/d", None)[-2:] == ["--model", "/t"]  # no drafter: the baseline


def test_taken_port_is_a_clear_error(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        s = engines.make(EngineParams(port=port), "/t", "/d", None, tmp_path)
        with pytest.raises(EngineError, match=f"port {port} on 127.0.0.1 to be free.*taken"):
            s.start()
    assert s.proc is None


def test_sglang_refuses_wrong_flags_before_launch(tmp_path):
    cmd = ["python", "-m", "sglang.launch_server", "--model-path", "/t"] + sglang_launch_args("/d", 3)
    cmd[cmd.index("EAGLE3")] = "EAGLE"
    s = engines.sglang.SGLang(cmd, tmp_path / "x.log")
    with pytest.raises(EngineError, match="EAGLE3"):
        s.start()
    assert s.proc is None and not (tmp_path / "x.log").exists()


def test_sglang_meta_info_aggregation():
    # two requests' meta_info as SGLang 0.5.17's tokenizer_manager writes them (depth 3)
    metas = [
        {
            "completion_tokens": 11,
            "spec_verify_ct": 4,
            "spec_num_correct_drafts": 7,
            "spec_correct_drafts_histogram": [1, 0, 2, 1],
        },
        {
            "completion_tokens": 6,
            "spec_verify_ct": 4,
            "spec_num_correct_drafts": 2,
            "spec_correct_drafts_histogram": [2, 2],
        },
    ]
    a = engines.sglang.aggregate_meta(metas)
    assert a["accept_len"] == 17 / 8 and a["accepted"] == 9 and a["histogram"] == [3, 2, 2, 1]
    assert a["per_pos"] == [5 / 8, 3 / 8, 1 / 8]  # share of verify steps with more than k correct drafts
    assert a["accept_len"] == pytest.approx(1 + sum(a["per_pos"]))


def test_vllm_metrics_parsing():
    before = engines.vllm.parse_metrics('# HELP x\nvllm:num_requests_running{engine="0"} 0.0\n')
    zeros = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "prefill_s": 0.0, "decode_s": 0.0}
    assert before == zeros | {"per_pos": []}
    text = textwrap.dedent("""\
        vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
        vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
        vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
        vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
        vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
        vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
        vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
        vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 1.5
        vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 3.0
        vllm:request_decode_time_seconds_sum{engine="0",model_name="m"} 4.5
        """)
    after = engines.vllm.parse_metrics(text)
    assert after["per_pos"] == [7.0, 4.0, 1.0]
    d = engines.vllm.stats_diff(before, after)
    assert d["accept_len"] == 1 + 12 / 10 and d["per_pos"] == [0.7, 0.4, 0.1]
    assert (d["prefill_s"], d["decode_s"]) == (1.5, 4.5)  # sums only, not the histograms' counts


# ------------------------------------------------------------------ real vLLM server ----


@pytest.mark.slow
def test_vllm_serves_drafter_and_stops_whole_group(drafts, learned, tmp_path):
    """The learned drafter served at depth 3 in fp32: vLLM reproduces the greedy continuation and accepts most
    drafts (a drafter fed the wrong aux states, or none, gets ~nothing: test_provenance's cold drafter < 1.2),
    its own log reports speculative decoding, and stop() leaves no process."""
    need("vllm")
    server = engines.make(fast(), drafts["target"], drafts["vllm"], 3, tmp_path, dtype="float32")
    with server:
        assert server.ready_s > 0 and server.url.startswith("http://127.0.0.1:")
        members = alive_in_group(server.group)
        assert len(members) >= 3, members  # guard, API server, engine core
        # the same port again: a clear error, and the running server is untouched
        other = engines.make(EngineParams(port=server.port), drafts["target"], None, None, tmp_path / "2")
        with pytest.raises(EngineError, match="taken"):
            other.start()
        # another port, the same cores: refused before it launches, this server's worker named (vLLM pins it;
        # two workers on one core starve each other)
        worker = [w for w in engines.vllm.pinned_vllm_workers() if w["pid"] in members]
        assert len(worker) == 1 and str(server.port) in worker[0]["server"], worker
        other = engines.make(EngineParams(), drafts["target"], None, None, tmp_path / "3")
        with pytest.raises(EngineError, match=f"pid {worker[0]['pid']} on cores"):
            other.start()
        assert other.proc is None
        before = server.stats()
        out = server.generate(learned["prompts"][0], MAX_TOKENS)
        spec = engines.vllm.stats_diff(before, server.stats())
    assert out["token_ids"] == learned["greedy"][0] and out["finish_reason"] == "length"
    assert spec["drafts"] > 0 and spec["draft_tokens"] == 3 * spec["drafts"] and len(spec["per_pos"]) == 3
    assert spec["accept_len"] > 2.0 and spec["per_pos"][0] >= 0.7, spec  # 7 of 10 on an Intel Xeon, more on EPYCs
    assert alive_in_group(server.group) == [], "processes survived stop()"
    engine_lines = server.log_path.read_text().splitlines()[1:]  # the first line is our own command
    assert any("num_spec_tokens=3" in line and "eagle3" in line for line in engine_lines)
    assert any("Resolved architecture: LlamaForCausalLMEagle3" in line for line in engine_lines)
    assert any("Loading drafter model" in line for line in engine_lines)
    # the drafter's argmax over its own vocabulary (LocalArgmaxMixin), the greedy reply as above
    assert any("Using local argmax reduction" in line for line in engine_lines)


@pytest.mark.slow
def test_regeneration_through_the_engine_equals_hf_greedy(embedded_cache, embedded_target, tmp_path):
    """data.regenerate with backend "engine": a vLLM server (no drafter, fp32) writes the same replies
    as model.generate in this process, multi-turn included, and is stopped afterwards."""
    from eagle3lib.params import RegenerateParams
    from eagle3lib.prepare import regenerate

    need("vllm")
    model, tokenizer = embedded_target
    convs = [
        {
            "id": "two-turns",
            "messages": [
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Spain?"},
                {"role": "assistant", "content": "Madrid."},
            ],
        },
        {
            "id": "colors",
            "messages": [{"role": "user", "content": "Name three colors."}, {"role": "assistant", "content": "Red."}],
        },
        {"id": "hi", "messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]},
    ]
    rg = dict(budget_tokens=200, max_new_tokens=20, batch_size=2)
    hf = regenerate.regenerate(
        RegenerateParams(**rg), model, tokenizer, convs, tmp_path / "hf" / "regenerated.jsonl", progress=False
    )
    out = tmp_path / "engine" / "regenerated.jsonl"
    engine = regenerate.regenerate(
        RegenerateParams(**rg, backend="engine"),
        model,
        tokenizer,
        convs,
        out,
        engine_params=fast(),
        target_dir=embedded_cache[1],
        progress=False,
        dtype="float32",  # the target's dtype reaches the engine
    )
    assert engine["backend"] == "engine:vllm" and engine["engine_start_s"] > 0
    log = (out.parent / engine["engine_log"]).read_text()
    assert log.startswith("$ ") and "--dtype float32" in log.splitlines()[0]
    for key in ("regenerated", "turns_regenerated", "tokens_generated", "stops"):
        assert engine[key] == hf[key], key
    assert regenerate.read_regenerated(out) == regenerate.read_regenerated(tmp_path / "hf" / "regenerated.jsonl")
    assert hf["turns_regenerated"] >= 3  # the two-turn conversation got both its turns back


@pytest.mark.slow
def test_missing_drafter_fails_with_log_tail_and_no_process(drafts, tmp_path):
    need("vllm")
    server = engines.make(fast(), drafts["target"], tmp_path / "no-such-drafter", 3, tmp_path)
    with pytest.raises(EngineError, match=r"(?s)exited with status \d+ during start.*Last lines of .*no-such-drafter"):
        server.start()
    assert alive_in_group(server.group) == [] and server.proc is None


@pytest.mark.slow
def test_start_timeout_stops_the_starting_server(drafts, tmp_path):
    need("vllm")
    server = engines.make(EngineParams(start_timeout_s=12), drafts["target"], None, None, tmp_path)
    with pytest.raises(EngineError, match=r"(?s)not healthy .* after 12 s.*Last lines of"):
        server.start()
    assert alive_in_group(server.group) == []


SCRIPT = """
import sys, time
from eagle3lib import engines
from eagle3lib.params import EngineParams
s = engines.make(EngineParams(), sys.argv[1], None, None, sys.argv[2])
s.start_timeout_s = 600
import threading
threading.Thread(target=s.start, daemon=True).start()
while s.group is None:
    time.sleep(0.1)
print(s.group, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_no_orphan_when_the_parent_is_killed(drafts, tmp_path):
    """kill -9 of the Python process that started the server (no finally, no atexit): the guard ends the group."""
    need("vllm")
    parent = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(drafts["target"]), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    group = int(parent.stdout.readline())
    try:
        deadline = time.time() + 120
        while len(alive_in_group(group)) < 3 and time.time() < deadline:  # guard, API server, its engine core
            time.sleep(0.5)
        assert len(alive_in_group(group)) >= 3, (
            alive_in_group(group),
            (tmp_path / "vllm-baseline.log").read_text()[-2000:],
        )
        parent.kill()
        parent.wait()
        deadline = time.time() + 60
        while alive_in_group(group) and time.time() < deadline:
            time.sleep(0.5)
        assert alive_in_group(group) == [], "engine processes outlived their parent"
    finally:
        if alive_in_group(group):
            os.killpg(group, signal.SIGKILL)


# ---------------------------------------------------------------------- SGLang check ----


def test_sglang_preflight_resolves_flags(drafts):
    py = need("sglang")
    report = engines.sglang.preflight(drafts["target"], drafts["sglang"], 4, py)
    assert report["resolved"]["speculative_num_steps"] == 4
    assert report["resolved"]["speculative_num_draft_tokens"] == 5 and report["captured_hf_layers"] == AUX
    # a drafter that needs other layers than the export's ids make SGLang capture: said, not launched
    with pytest.raises(
        EngineError, match=r"SGLang will capture HF hidden_states \[2, 15, 27\].*but \[3, 15, 27\] were asked"
    ):
        engines.sglang.preflight(drafts["target"], drafts["sglang"], 4, py, aux_layer_ids=[3, 15, 27])


def test_vllm_cpu_worker_threads_leave_the_reserved_cpus_to_the_api_server():
    import os

    cpus = len(os.sched_getaffinity(0))
    assert engines.vllm.cpu_worker_threads({}) == max(1, cpus - 1)
    assert engines.vllm.cpu_worker_threads({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}) == cpus
