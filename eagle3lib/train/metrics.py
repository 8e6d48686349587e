"""Draft quality, named once (docs/design.md §5).

step_acc[k]  share of valid positions whose step-k draft (fed its own earlier outputs)
             equals the target's argmax k+1 tokens ahead
cond_acc[k]  the same, counted only where steps 0..k-1 were all right
joint_acc[k] = Π_{j≤k} cond_acc[j]: share of positions whose first k+1 drafts are all right;
             what engines report per position
est_accept_len[d] = 1 + Σ_{k<d} joint_acc[k] for a chain of depth d

Depths beyond the trained steps K reuse cond_acc[K-1] and are marked extrapolated.
"""

from __future__ import annotations

import torch


class AcceptanceCounter:
    """Accumulates right/valid counts per TTT step over any number of batches."""

    def __init__(self, steps: int):
        self.steps = steps
        self.valid = torch.zeros(steps, dtype=torch.float64)
        self.right = torch.zeros(steps, dtype=torch.float64)
        self.cond_valid = torch.zeros(steps, dtype=torch.float64)
        self.cond_right = torch.zeros(steps, dtype=torch.float64)

    def update(self, right: torch.Tensor, valid: torch.Tensor) -> None:
        """right, valid: bool [K, ...] per step and position."""
        right, valid = right.reshape(self.steps, -1).bool(), valid.reshape(self.steps, -1).bool()
        prefix_right = torch.ones_like(right[0])
        prefix_valid = torch.ones_like(valid[0])
        for k in range(self.steps):
            prefix_valid = prefix_valid & valid[k]
            self.valid[k] += valid[k].sum()
            self.right[k] += (right[k] & valid[k]).sum()
            cond = prefix_valid & prefix_right
            self.cond_valid[k] += cond.sum()
            self.cond_right[k] += (cond & right[k]).sum()
            prefix_right = prefix_right & right[k]

    def summary(self, max_depth: int | None = None) -> dict:
        return acceptance_summary(
            self.right / self.valid.clamp(min=1),
            self.cond_right / self.cond_valid.clamp(min=1),
            max_depth,
            positions=int(self.valid[0].item()),
        )


def acceptance_summary(step_acc, cond_acc, max_depth: int | None = None, positions: int | None = None) -> dict:
    step_acc = [float(x) for x in step_acc]
    cond_acc = [float(x) for x in cond_acc]
    steps = len(cond_acc)
    max_depth = max(max_depth or steps, steps)
    extended = cond_acc + [cond_acc[-1]] * (max_depth - steps)
    joint, run = [], 1.0
    for c in extended:
        run *= c
        joint.append(run)
    est = {d: 1.0 + sum(joint[:d]) for d in range(1, max_depth + 1)}
    return {
        "step_acc": step_acc,
        "cond_acc": cond_acc,
        "joint_acc": joint[:steps],
        "est_accept_len": {str(d): round(v, 4) for d, v in est.items()},
        "extrapolated_depths": [d for d in est if d > steps],
        "trained_steps": steps,
        "positions": positions,
    }
