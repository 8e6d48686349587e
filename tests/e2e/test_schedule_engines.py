"""The engines' own code reads a DepthSchedule as written: vLLM's scheduler lookup and SGLang's adaptive routing
give every batch size the schedule's depth."""

import json
import subprocess

from conftest import need_engine

from eagle3lib import engines
from eagle3lib.engines.schedule import DepthSchedule

SCHEDULE = DepthSchedule(((1, 5), (2, 3), (4, 1), (8, 0)))
BATCHES = list(range(1, 70))

VLLM_LOOKUP = """
import json, sys
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
config = json.loads(sys.argv[1])
lookup = build_dynamic_sd_schedule_lookup(config["num_speculative_tokens_per_batch_size"], 64, config["num_speculative_tokens"])
print(json.dumps(lookup[1:]))
"""

SGLANG_ROUTE = """
import json, sys
from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams
params = AdaptiveSpeculativeParams(initial_steps=int(sys.argv[2]), cfg_path=sys.argv[1])
print(json.dumps([params.get_steps_for_batch(b) for b in range(1, 70)]))
"""


def engine_answer(python: str, code: str, *args: str) -> list[int]:
    done = subprocess.run([python, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_vllms_scheduler_gives_each_batch_size_the_schedules_depth():
    config = engines.vllm.speculative_config("/d", SCHEDULE)
    got = engine_answer(need_engine("vllm"), VLLM_LOOKUP, json.dumps(config))
    assert got == [SCHEDULE.depth_at(b) for b in range(1, 65)]


def test_sglangs_adaptive_controller_gives_each_batch_size_the_schedules_depth(tmp_path):
    cmd = engines.launch_command("sglang", "/t", "/d", SCHEDULE, config_dir=tmp_path)
    path = cmd[cmd.index("--speculative-adaptive-config") + 1]
    steps = cmd[cmd.index("--speculative-num-steps") + 1]
    got = engine_answer(need_engine("sglang"), SGLANG_ROUTE, path, steps)
    assert got == [SCHEDULE.depth_at(b) for b in BATCHES]
