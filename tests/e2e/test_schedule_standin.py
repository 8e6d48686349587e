"""The sweep's depth schedule is the one its measurements imply, deployed as the engine launches it: a stand-in
vLLM server (tests/standin_vllm.py) whose speed per depth and load is set here, measured by our client and by the
real `vllm bench serve` (the vLLM environment's), with no speculation the choice at the higher load and a latency
target that nothing meets."""

import json
import shutil
from pathlib import Path

from conftest import need_engine

from eagle3lib.engines.schedule import DepthSchedule
from eagle3lib.params import EngineParams, load_params
from eagle3lib.speedup import load, schedule, sweep, under_load

HERE = Path(__file__).resolve().parents[1]

# depth -> {at least this many in flight: ms per output token}. At 1 in flight depth 3 is fastest (15 ms a token);
# from 3 in flight speculation loses to no speculation (20 ms against 60 and 80).
MS_PER_TOKEN = {"0": {"1": 40, "3": 20}, "1": {"1": 25, "3": 60}, "3": {"1": 15, "3": 80}}


def standin_engine(tmp_path: Path) -> EngineParams:
    """The vLLM environment's interpreter, with the stand-in first on its PYTHONPATH as vLLM's server module."""
    module = tmp_path / "standin" / "vllm" / "entrypoints" / "openai"
    module.mkdir(parents=True)
    for folder in (module, module.parent, module.parent.parent):
        (folder / "__init__.py").write_text("")
    shutil.copyfile(HERE / "standin_vllm.py", module / "api_server.py")
    env = {
        "PYTHONPATH": str(tmp_path / "standin"),
        "STANDIN_LAUNCHES": str(tmp_path / "launches.jsonl"),
        "STANDIN_MS_PER_TOKEN": json.dumps(MS_PER_TOKEN),
    }
    return EngineParams(name="vllm", python=need_engine("vllm"), env=env, start_timeout_s=120)


def test_the_deployed_schedule_is_the_one_the_measurements_imply(tmp_path, embedded_cache):
    engine = standin_engine(tmp_path)
    overrides = {"bench.depths": [1, 3], "bench.concurrency": [1, 4], "bench.pick_depth": False}
    overrides |= {"bench.load_prompts": 4, "bench.max_tokens": 12, "bench.slo_itl_p90_ms": 5}
    bench = load_params(str(HERE / "params" / "ci.yaml"), overrides).bench
    prompts = [
        {"id": f"held_out/{i}", "set": "held_out", "category": "", "turn": 1, "prompt_ids": [1, 2, 3, i],
         "messages": [{"role": "user", "content": f"question {i}"}]}
        for i in range(4)
    ]  # fmt: skip
    target_dir = str(embedded_cache[1])  # the tokenizer vllm bench serve counts with
    sweeping = load.LoadSweep(
        load.load_points(bench),
        ["a question about the weather in spring"] * 4,
        12,
        engine,
        target_dir,
        tmp_path / "load",
    )
    swept = sweep.benchmark(engine, bench, target_dir, "/drafter", prompts, tmp_path, progress=None, load=sweeping)

    # measured: depth 3 at 1 in flight, no speculation at 4; nothing meets 5 ms, so the lowest latency, said so
    derived = schedule.derive(swept["rows"], bench.slo_itl_p90_ms)
    assert derived["schedule"] == DepthSchedule(((1, 3), (4, 0)))
    assert [s["meets_target"] for s in derived["steps"]] == [False, False]
    assert swept["schedule"]["schedule"] == [[1, 3], [4, 0]] and swept["schedule"]["deployed"]
    # deployed as vLLM's own per-batch-size schedule, the last server launched
    launched = [json.loads(line) for line in (tmp_path / "launches.jsonl").read_text().splitlines()]
    assert launched[0] is None and [c["num_speculative_tokens"] for c in launched[1:3]] == [1, 3]
    assert launched[-1]["num_speculative_tokens_per_batch_size"] == [[1, 3, 3], [4, 65536, 0]]
    # measured under the same load points as the fixed configurations, by the real load generator
    configs = {r["config"] for r in swept["load"]}
    assert configs == {"baseline-float32", "depth1-float32", "depth3-float32", "schedule-3.0-float32"}
    assert all(r["completed"] == 4 and r["p90_itl_ms"] > 10 for r in swept["load"])
    against = under_load.schedule_against_fixed(swept["load"])
    assert [p["best_fixed"] for p in against["points"]] == ["depth3-float32", "baseline-float32"]
    # at each load the schedule ran the best fixed configuration's depth: its per-token time, as the stand-in sets it
    # (tokens/s over a fraction of a second is too short a window to compare)
    best_itl = {(r["config"], r["load"]): r["p90_itl_ms"] for r in swept["load"]}
    for p in against["points"]:
        assert abs(p["itl_p90_ms"] / best_itl[(p["best_fixed"], p["load"])] - 1) < 0.15, against
    assert "no configuration meets p90 inter-token latency <= 5 ms" in under_load.schedule_text(
        swept["schedule"], against
    )
