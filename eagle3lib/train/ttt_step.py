"""The training-time-test (TTT) step of the EAGLE-3 drafter: the chain's loss and one optimizer step.

Per packed row and TTT step k, position t predicts the token after t+1+k: its target is the target model's
distribution there (lm_head(final_hidden[t+1+k]) restricted to the draft vocabulary), its input the ground-truth
token t+1+k and the drafter's own hidden state from step k-1. Loss: soft cross-entropy, step k weighted
step_weight_decay**k, over positions whose predicted token is an assistant token of the same document (or any
token of it: train.loss_positions), the aux states optionally with noise (train.aux_noise).

Data parallel: every rank is given a step's whole group of micro-batches and computes every world-th; the loss is
normalized by the group's count of valid positions, so the gradients summed over ranks are those of one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from eagle3lib import hardware
from eagle3lib.drafter import Drafter
from eagle3lib.drafter.ttt_attention import row_layout
from eagle3lib.train.loss import LOSS_TARGETS, compute_dtype, linear_soft_ce, target_probs
from eagle3lib.train.runtime.batches import batch_states, batch_to
from eagle3lib.train.runtime.distributed import all_reduce_grads


def shift_left(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """x[:, t + k] at t (dim 1), padded with fill at the end."""
    if k == 0:
        return x
    pad = [0, 0] * (x.dim() - 2) + [0, k]
    return F.pad(x[:, k:], pad, value=fill)


def target_argmax(final: torch.Tensor, head: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """argmax over the full target vocab, in chunks of positions to bound memory."""
    flat = final.reshape(-1, final.shape[-1])
    out = torch.cat([(flat[i : i + chunk] @ head.T).argmax(-1) for i in range(0, flat.shape[0], chunk)])
    return out.view(final.shape[:-1])


def valid_positions(batch: dict, k: int) -> torch.Tensor:
    """bool [B,T]: TTT step k at t has a target, the distribution at t+1+k, predicting an
    assistant token (loss mask) of the same document."""
    docs, mask = batch["doc_ids"], batch["loss_mask"]
    label_ok = (shift_left(docs, 1, fill=-2) == docs) & (docs >= 0) & (shift_left(mask, 1) > 0)
    return shift_left(label_ok, 1 + k, fill=False) & (shift_left(docs, 1 + k, fill=-2) == docs)


def every_token(batch: dict) -> dict:
    """The batch with every token of its documents in the loss mask (train.loss_positions: all)."""
    return {**batch, "loss_mask": (batch["doc_ids"] >= 0).to(batch["loss_mask"].dtype)}


# train.loss_positions: which positions a training batch fits (the validation keeps the assistant's)
LOSS_POSITIONS = {"assistant": lambda batch: batch, "all": every_token}


def with_aux_noise(aux: torch.Tensor, hidden_size: int, scale: float, generator: torch.Generator) -> torch.Tensor:
    """aux [.., n·H] plus Gaussian noise whose std is `scale` times each of its n states' RMS at that token."""
    parts = aux.unflatten(-1, (-1, hidden_size))
    rms = parts.float().pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.randn(parts.shape, generator=generator, device=aux.device)
    return (parts.float() + noise * (scale * rms)).to(aux.dtype).flatten(-2)


def with_host_layout(batch: dict, steps: int) -> dict:
    """The batch with what the step would otherwise read back from the GPU, made from its host copy before it
    moves: the rows' layout for the attention kernels (row_layout) and each TTT step's valid rows for the loss."""
    loss_rows = [valid_positions(batch, k).flatten().nonzero().flatten() for k in range(steps)]
    return {**batch, "row_layout": row_layout(batch["doc_ids"]), "loss_rows": loss_rows}


def ttt_loss_sums(
    drafter: Drafter,
    batch: dict,
    embed: torch.Tensor,
    head_full: torch.Tensor,
    steps: int,
    with_metrics: bool = True,
    checkpoint: bool = False,
    fused_loss: bool | None = None,
    attention: str = "auto",
    only_valid_rows: bool = True,
    loss_target=target_probs,
    aux_noise: tuple[float, torch.Generator] | None = None,
):
    """Run the TTT chain on a batch. Returns, per step: Σ over valid positions of the soft CE
    against the target's distribution on the draft vocab, the valid counts, and (with_metrics)
    whether the draft's argmax is the target's argmax over the full vocab, with the valid masks.
    fused_loss: the loss's per-chunk kernel compiled (default: on CUDA; loss.chunk_kernel).
    only_valid_rows: the lm_head scores only each step's valid positions (linear_soft_ce's only_valid;
    False scores every position, the same loss for more work: an ablation).
    loss_target: the target's side of the loss (loss.LOSS_TARGETS: its distribution, or its top token one-hot).
    aux_noise: (scale, generator): the drafter reads the aux states with noise (with_aux_noise; training only).
    A batch made with with_host_layout brings its row layout and valid rows; else they are read from the GPU."""
    ids, docs = batch["input_ids"], batch["doc_ids"]
    dtype = drafter.fc.weight.dtype
    aux, final = batch_states(batch, dtype)
    if aux_noise:
        aux = with_aux_noise(aux, drafter.cfg.target_hidden_size, *aux_noise)
    compute = compute_dtype(aux.device.type, dtype)
    with torch.no_grad():
        probs = loss_target(final, head_full[drafter.t2d].to(compute), compute)  # [B·T, V_draft]
        # The full-vocab argmax costs as much as a target lm_head; only metrics need it.
        target_best = target_argmax(final.float(), head_full.float()) if with_metrics else None
    # Step k at t is fed token t+1+k: one tensor of the next tokens, K-1 longer, serves all steps.
    embeds = F.embedding(F.pad(ids[:, 1:], (0, steps)), embed).to(dtype)
    hidden = drafter.ttt_forward(
        aux,
        embeds,
        batch["position_ids"],
        docs,
        attention=attention,
        checkpoint=checkpoint,
        layout=batch.get("row_layout"),
    )
    loss_rows = batch.get("loss_rows")
    sums, counts, rights, valids = [], [], [], []
    for k in range(steps):
        valid = valid_positions(batch, k)
        loss, best = linear_soft_ce(
            drafter.norm(hidden[k]),
            drafter.lm_head.weight,
            probs,
            valid,
            offset=1 + k,
            dtype=compute,
            fused=fused_loss,
            only_valid=only_valid_rows,
            rows=loss_rows[k] if loss_rows else None,
        )
        sums.append(loss)
        counts.append(valid.sum())
        valids.append(valid)
        if with_metrics:
            rights.append(drafter.draft_to_target(best) == shift_left(target_best, 1 + k))
    return torch.stack(sums), torch.stack(counts), torch.stack(rights) if with_metrics else None, torch.stack(valids)


class TrainStep:
    """One optimizer step on a group of micro-batches: every rank is given the whole group and computes its
    share (every world-th); the loss of each TTT step k, weighted step_weight_decay**k, is normalized by the
    group's count of valid positions, so the gradients summed over ranks are those of one process. setup: what
    trains (its drafter) against what (the target's frozen embed and head): loop.TrainSetup."""

    def __init__(
        self, setup, optimizer: torch.optim.Optimizer, train_params, device, rank: int, world: int, seed: int = 0
    ):
        self.setup, self.optimizer, self.train_params, self.seed = setup, optimizer, train_params, seed
        self.device, self.rank, self.world = device, rank, world
        self.trainable = [p for g in optimizer.param_groups for p in g["params"]]
        self.weights = torch.tensor(
            [train_params.step_weight_decay**k for k in range(train_params.ttt_steps)], device=device
        )
        self.loss_target = LOSS_TARGETS[train_params.loss_target]
        self.loss_positions = LOSS_POSITIONS[train_params.loss_positions]
        self.device_type = torch.device(device).type
        self.bf16 = hardware.resolve(train_params.dtype, self.device_type) == "bfloat16"

    def __call__(self, group: list[tuple[int, int, dict]], lr: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(loss, gradient norm) of the step at learning rate lr; a non-finite loss leaves the weights as they
        were and comes back with no gradient norm."""
        train_params, device = self.train_params, self.device
        group = [(epoch, micro, self.loss_positions(mb)) for epoch, micro, mb in group]
        counts = torch.zeros(train_params.ttt_steps, device=device)
        for _, _, mb in group:  # global normalizer, identical on every rank without communication
            counts += torch.stack([valid_positions(mb, k).sum() for k in range(train_params.ttt_steps)]).to(device)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=device)
        for epoch, micro, mb in group[self.rank :: self.world]:
            batch = batch_to(with_host_layout(mb, train_params.ttt_steps), device)
            # the noise of a micro-batch depends on where it is in the run only, so a resumed run draws the same
            noise = None
            if train_params.aux_noise:
                generator = torch.Generator(device).manual_seed(self.seed * 1_000_003 + epoch * 100_003 + micro)
                noise = (train_params.aux_noise, generator)
            with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.bf16):
                sums, _, _, _ = ttt_loss_sums(
                    self.setup.drafter,
                    batch,
                    self.setup.embed,
                    self.setup.head,
                    train_params.ttt_steps,
                    with_metrics=False,
                    checkpoint=train_params.activation_checkpointing,
                    attention=train_params.attention,
                    loss_target=self.loss_target,
                    aux_noise=noise,
                )
            loss = (self.weights * sums / counts.clamp(min=1)).sum()
            loss.backward()
            step_loss += loss.detach()
        all_reduce_grads(self.trainable, self.world)
        if self.world > 1:
            dist.all_reduce(step_loss)
        if not torch.isfinite(step_loss):
            return step_loss, None
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, train_params.grad_clip)
        self.optimizer.step()
        return step_loss, grad_norm
