"""engines/schedule.py: a depth per batch size, and the launch flags that carry it to each engine."""

import json

import pytest

from eagle3lib import engines
from eagle3lib.engines.schedule import ANY_LARGER_BATCH, DepthSchedule, as_schedule


def test_each_batch_size_gets_the_depth_of_the_last_step_at_or_below_it():
    s = DepthSchedule(((1, 3), (4, 1), (8, 0)))
    assert [s.depth_at(b) for b in (1, 2, 3, 4, 7, 8, 64)] == [3, 3, 3, 1, 1, 0, 0]
    assert s.max_depth == 3 and not s.is_fixed and s.name() == "schedule-3.1.0"
    assert s.text() == "depth 3 at 1-3, depth 1 at 4-7, none from 8 in flight"
    assert DepthSchedule.from_json(s.as_json()) == s


@pytest.mark.parametrize(
    "steps",
    [(), ((2, 3),), ((1, 3), (1, 2)), ((1, 3), (8, 2), (4, 1)), ((1, -1),)],
    ids=["empty", "not-from-1", "repeated", "unsorted", "negative"],
)
def test_a_schedule_that_leaves_a_batch_size_without_a_depth_is_refused(steps):
    with pytest.raises(ValueError, match="depth schedule"):
        DepthSchedule(steps)


def test_vllm_reads_inclusive_ranges_covering_every_batch_size():
    s = DepthSchedule(((1, 3), (2, 2), (8, 0)))
    assert s.vllm_ranges() == [[1, 1, 3], [2, 7, 2], [8, ANY_LARGER_BATCH, 0]]
    config = engines.vllm.speculative_config("/d", s)
    assert config["num_speculative_tokens"] == 3 and config["num_speculative_tokens_per_batch_size"] == s.vllm_ranges()
    # a fixed depth launches as before: no schedule entry
    assert "num_speculative_tokens_per_batch_size" not in engines.vllm.speculative_config("/d", 5)


def test_sglang_holds_the_adaptive_controller_to_one_candidate_per_batch_size(tmp_path):
    s = DepthSchedule(((1, 5), (4, 2), (16, 0)))
    cmd = engines.launch_command("sglang", "/t", "/d", s, config_dir=tmp_path)
    flag = cmd.index("--speculative-adaptive-config")
    assert "--speculative-adaptive" in cmd and cmd[cmd.index("--speculative-num-steps") + 1] == "5"
    assert cmd[cmd.index("--speculative-num-draft-tokens") + 1] == "6"
    written = json.loads(open(cmd[flag + 1]).read())
    assert written == {"1": {"candidate_steps": [5]}, "4": {"candidate_steps": [2]}, "16": {"candidate_steps": [0]}}
    with pytest.raises(ValueError, match="folder"):
        engines.launch_command("sglang", "/t", "/d", s)
    assert "--speculative-adaptive" not in engines.launch_command("sglang", "/t", "/d", 4)


def test_no_depth_anywhere_is_the_baseline():
    assert as_schedule(DepthSchedule(((1, 0), (4, 0)))) is None and as_schedule(0) is None and as_schedule(None) is None
    assert engines.config_name(DepthSchedule(((1, 0),))) == "baseline"
    assert "--speculative-config" not in engines.launch_command("vllm", "/t", "/d", DepthSchedule(((1, 0), (2, 0))))
    assert engines.config_name(DepthSchedule.fixed(5), "float32") == "depth5-float32"
