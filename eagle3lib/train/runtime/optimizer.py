"""The drafter's optimizer: AdamW over every trainable weight, or Muon over the 2D matrices of the layer and fc
with AdamW over the rest (the draft head, norms), as speculators 0.9.0 trains by default; and the learning rate's
schedule."""

from __future__ import annotations

import math

import torch

# 2D weights that stay with AdamW under Muon: vocabulary-sized matrices (Keller Jordan's convention, speculators' too)
ADAMW_NAME_HINTS = ("embed_tokens", "lm_head")


def split_for_muon(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(Muon's parameters: trainable 2D matrices other than the vocabulary's, AdamW's: the rest)."""
    muon, adamw = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        is_matrix = param.ndim == 2 and min(param.shape) > 1
        (muon if is_matrix and not any(h in name for h in ADAMW_NAME_HINTS) else adamw).append(param)
    return muon, adamw


class MuonWithAdamW:
    """torch.optim.Muon over the matrices and AdamW over the rest, stepped as one optimizer: param_groups lists
    both's groups (the loop sets one learning rate on all), state_dict holds both."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.muon, self.adamw = muon, adamw

    @property
    def param_groups(self) -> list[dict]:
        return self.muon.param_groups + self.adamw.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"muon", "adamw"}:
            raise ValueError(f"expected a Muon+AdamW optimizer state (keys muon, adamw), found keys {sorted(state)}")
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def make_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float, device):
    """AdamW (betas 0.9/0.95, fused on CUDA) or Muon+AdamW (Muon's update scaled to AdamW's RMS, so that one lr
    serves both groups, as speculators does)."""
    fused = torch.device(device).type == "cuda"  # one CUDA kernel for the whole update instead of a foreach chain

    def adamw(params):
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, fused=fused)

    if name == "adamw":
        return adamw([p for p in model.parameters() if p.requires_grad])
    if name == "muon":
        muon_params, adamw_params = split_for_muon(model)
        if not muon_params:
            raise ValueError("train.optimizer muon: the drafter has no trainable 2D matrix for Muon; use adamw")
        muon = torch.optim.Muon(muon_params, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        return MuonWithAdamW(muon, adamw(adamw_params))
    raise ValueError(f"train.optimizer {name!r}: expected adamw or muon")


def lr_at(step: int, total_steps: int, lr: float, warmup: int, final_fraction: float = 0.1) -> float:
    """Linear warmup, then cosine decay to final_fraction·lr at total_steps."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return lr * (final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))
