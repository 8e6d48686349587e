"""A speculative depth per batch size, as both engines take it (docs/design.md §5).

    DepthSchedule.fixed(5)                      # depth 5 at every batch size: the plain launch flags
    DepthSchedule(((1, 3), (4, 1), (8, 0)))     # depth 3 for 1-3 requests in flight, 1 for 4-7, none from 8

Each step (first batch size, depth) holds up to the next step's first batch size; the last holds for every larger
batch. Depth 0 is no speculation at that batch size. The engines read it as:
- vLLM: speculative_config.num_speculative_tokens_per_batch_size, inclusive (first, last, tokens) ranges
  (vllm/v1/spec_decode/dynamic/utils.py), num_speculative_tokens the deepest step;
- SGLang: --speculative-adaptive with a --speculative-adaptive-config file whose batch-size keys each give one
  candidate step (sglang/srt/speculative/adaptive_spec_params.py: a batch uses the largest key not above its
  size, and a single candidate leaves the adaptive controller nothing to change).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# vLLM's last range: every batch size a server can hold (its lookup stops at max_num_seqs)
ANY_LARGER_BATCH = 1 << 16


@dataclass(frozen=True)
class DepthSchedule:
    """(first batch size, depth) steps, sorted, the first at batch size 1."""

    steps: tuple[tuple[int, int], ...]

    def __post_init__(self):
        starts = [s for s, _ in self.steps]
        if not self.steps or starts[0] != 1 or starts != sorted(set(starts)):
            raise ValueError(
                f"a depth schedule's steps start at batch size 1 and rise, one per batch size; got {list(self.steps)}"
            )
        if any(d < 0 for _, d in self.steps):
            raise ValueError(f"a depth schedule's depths are 0 (no speculation) or more; got {list(self.steps)}")

    @classmethod
    def fixed(cls, depth: int) -> DepthSchedule:
        return cls(((1, int(depth)),))

    @classmethod
    def from_json(cls, data) -> DepthSchedule:
        """From as_json()'s list of [first batch size, depth]."""
        return cls(tuple((int(s), int(d)) for s, d in data))

    def as_json(self) -> list[list[int]]:
        return [[s, d] for s, d in self.steps]

    @property
    def is_fixed(self) -> bool:
        return len(self.steps) == 1

    @property
    def max_depth(self) -> int:
        return max(d for _, d in self.steps)

    def depth_at(self, batch_size: int) -> int:
        return [d for s, d in self.steps if s <= batch_size][-1]

    def name(self) -> str:
        """'baseline', 'depth5' or 'schedule-3.1.0' (the depths from batch size 1 up): names logs and table rows."""
        if self.max_depth == 0:
            return "baseline"
        if self.is_fixed:
            return f"depth{self.max_depth}"
        return "schedule-" + ".".join(str(d) for _, d in self.steps)

    def text(self) -> str:
        """'depth 3 at 1-3 in flight, 1 at 4-7, none from 8'."""
        parts = []
        for i, (start, depth) in enumerate(self.steps):
            end = self.steps[i + 1][0] - 1 if i + 1 < len(self.steps) else None
            where = f"from {start}" if end is None else (f"at {start}" if end == start else f"at {start}-{end}")
            parts.append(f"{'none' if depth == 0 else f'depth {depth}'} {where}")
        return ", ".join(parts) + " in flight"

    def vllm_ranges(self) -> list[list[int]]:
        """vLLM's num_speculative_tokens_per_batch_size: inclusive [first, last, tokens] ranges."""
        ends = [s - 1 for s, _ in self.steps[1:]] + [ANY_LARGER_BATCH]
        return [[s, max(s, e), d] for (s, d), e in zip(self.steps, ends)]

    def sglang_adaptive_config(self) -> dict:
        """SGLang's adaptive config: one candidate step per batch-size key."""
        return {str(s): {"candidate_steps": [d]} for s, d in self.steps}

    def write_sglang_config(self, folder) -> Path:
        """The adaptive config as a file SGLang's --speculative-adaptive-config reads: folder/<name>.json."""
        path = Path(folder) / f"sglang-adaptive-{self.name()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.sglang_adaptive_config(), indent=2) + "\n")
        return path


def as_schedule(depth) -> DepthSchedule | None:
    """None (no speculation), a depth or a DepthSchedule as a DepthSchedule; None also for depth 0 everywhere."""
    if depth is None:
        return None
    schedule = depth if isinstance(depth, DepthSchedule) else DepthSchedule.fixed(depth)
    return schedule if schedule.max_depth > 0 else None


def varying(depth) -> DepthSchedule | None:
    """The DepthSchedule of `depth` when it changes depth with the load (several steps), else None."""
    schedule = as_schedule(depth)
    return schedule if schedule is not None and not schedule.is_fixed else None
