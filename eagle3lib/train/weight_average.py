"""train.ema_decay: an exponential moving average of the drafter's trainable weights, kept beside the optimizer and
evaluated and written in place of the last weights (Polyak averaging: on a few passes over scarce data the average
of the last few hundred steps generalizes better than any one of them).

    opt = with_weight_average(make_optimizer(...), drafter, decay)   # the optimizer itself when decay is None
    opt.step()                                                        # the inner step, then the average's
    with averaged_weights(opt):                                       # the drafter holds the average inside
        evaluate(...); save_drafter(...)

The average lives in the optimizer's state_dict, so a checkpoint holds it and a resume continues it exactly.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch


class WeightAverage:
    """An optimizer whose step also moves the average: shadow <- d·shadow + (1 - d)·weight with d = min(decay,
    (1 + n) / (10 + n)) after the n-th step (the warmup keeps the start's weights from dominating a short run).
    The shadow is fp32 on the weights' device."""

    def __init__(self, optimizer, model: torch.nn.Module, decay: float):
        if not 0 < decay < 1:
            raise ValueError(
                f"train.ema_decay {decay}: expected a value between 0 and 1 (e.g. 0.995), or null for none"
            )
        self.optimizer, self.decay, self.updates = optimizer, decay, 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shadow = [p.detach().float().clone() for p in self.params]

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()
        self.updates += 1
        weight = 1 - self.current_decay()
        for shadow, param in zip(self.shadow, self.params):
            shadow.lerp_(param.detach().float(), weight)

    @contextmanager
    def applied(self):
        """The drafter holds the averaged weights inside the block, its own again after it (however it ends)."""
        own = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for param, shadow in zip(self.params, self.shadow):
                param.copy_(shadow)
        try:
            yield
        finally:
            with torch.no_grad():
                for param, saved in zip(self.params, own):
                    param.copy_(saved)

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "weight_average": {"decay": self.decay, "updates": self.updates, "shadow": self.shadow},
        }

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"optimizer", "weight_average"}:
            raise ValueError(
                f"expected an optimizer state with a weight average (keys optimizer, weight_average), found keys "
                f"{sorted(state)}: the checkpoint was written without train.ema_decay"
            )
        average = state["weight_average"]
        shapes = [tuple(t.shape) for t in average["shadow"]]
        if shapes != [tuple(p.shape) for p in self.params]:
            raise ValueError(
                f"the checkpoint's weight average does not fit the drafter's weights ({len(shapes)} tensors)"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(average["updates"])
        for shadow, saved in zip(self.shadow, average["shadow"]):
            shadow.copy_(saved)


def with_weight_average(optimizer, model: torch.nn.Module, decay: float | None):
    """The optimizer, wrapped to keep the weights' average when train.ema_decay is set."""
    return optimizer if decay is None else WeightAverage(optimizer, model, decay)


def averaged_weights(optimizer):
    """A block in which the drafter holds the weights to evaluate and write: the average, or its own."""
    return optimizer.applied() if isinstance(optimizer, WeightAverage) else nullcontext()
