"""The EAGLE-3 training loop: the spine of 02_train. Read top to bottom, then in this order:

    train() and Loop.run here    steps until the schedule's end: take_step, evaluate_now every eval_every, checkpoint
    ttt_step.py                  one optimizer step: the drafter unrolled over ttt_steps (training-time test)
    loss.py, metrics.py          the soft cross-entropy against the target, and the acceptance it predicts
    ../drafter/model.py          the drafter: fc over the target's aux states, one decoder layer, the draft head

The machinery lives in runtime/ (setup, batches, checkpoints, optimizer, schedule, data parallel, speedups, launch)
and sources/ (where the states come from: 01_extract's shards, or the target run alongside, online).

    setup, _ = runtime.setup.build_setup(p, run_dir, device)   # what the run trains on
    summary = train(setup, p.train, seed, device)               # steps until max_tokens or max_minutes

Under torchrun every rank runs the same loop on the same stream: rank r computes every N-th micro-batch of a step,
gradients are summed with all_reduce and the loss is normalized by the global count of positions, so N processes
take exactly the step one process takes with the same global batch.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3lib.drafter import Drafter
from eagle3lib.train import TrainingError
from eagle3lib.train.metrics import AcceptanceCounter
from eagle3lib.train.runtime.batches import batch_to
from eagle3lib.train.runtime.best_kept import BEST, BestKept
from eagle3lib.train.runtime.checkpoint import (
    CHECKPOINTS,
    latest_checkpoint,
    resume,
    run_key,
    save_checkpoint,
    save_drafter,
)
from eagle3lib.train.runtime.distributed import check_same_weights, rank_and_world
from eagle3lib.train.runtime.optimizer import make_optimizer
from eagle3lib.train.runtime.schedule import Schedule
from eagle3lib.train.runtime.speedups import compile_decoder_layer, convert_to_float8
from eagle3lib.train.ttt_step import TrainStep, ttt_loss_sums, with_host_layout


@dataclass
class TrainSetup:
    """Everything the loop needs, built by the stage (setup.build_setup) or a test."""

    drafter: Drafter
    embed: torch.Tensor  # target input embeddings [V, H] (frozen)
    head: torch.Tensor  # target lm_head [V, H_t] (frozen)
    val_rows: list[dict]  # packed validation rows, each a batch of one
    contract: dict
    out_dir: Path
    source: object = None  # sources.BatchSource: the (epoch, index, micro-batch) stream; None: evaluation only
    inputs: dict = field(default_factory=dict)  # what identifies the training data, for resume (see run_key)


def train(setup: TrainSetup, train_params, seed: int = 0, device="cpu", max_depth: int = 16, log=print) -> dict:
    """The TTT loop with accumulation, AdamW or Muon, warmup+cosine, clipping, checkpoints, resume, and DDP."""
    return Loop(setup, train_params, seed, device, max_depth, log).run()


class Loop:
    """One run of the loop: the drafter on its device, the optimizer, the step, the schedule's length and the state
    (resumed from the latest checkpoint of the same run key, else new); rank 0 writes the log and checkpoints."""

    def __init__(self, setup: TrainSetup, train_params, seed: int, device, max_depth: int, log):
        self.setup, self.tp, self.device, self.max_depth, self.log = setup, train_params, device, max_depth, log
        self.rank, self.world = rank_and_world()
        self.drafter = setup.drafter.to(device)
        setup.embed, setup.head = setup.embed.to(device), setup.head.to(device)
        if train_params.float8:
            log(f"FP8 matmuls (torchao rowwise) in {', '.join(convert_to_float8(self.drafter))}")
        if train_params.compile_layer:
            compile_decoder_layer(self.drafter)
        tp = train_params
        self.opt = make_optimizer(self.drafter, tp.optimizer, tp.lr, tp.weight_decay, device)
        self.step = TrainStep(setup, self.opt, tp, device, self.rank, self.world, seed)
        self.ckpt_root = setup.out_dir / CHECKPOINTS
        self.log_path = setup.out_dir / "log.jsonl"
        key = run_key(setup, tp, seed)
        self.state = resume(
            self.drafter, self.opt, self.ckpt_root, self.log_path, device, key, tp.resume, self.rank, log
        )
        tokens_per_step = tp.batch_rows * tp.grad_accum * self.world * tp.max_seq_len
        self.schedule = Schedule(tp, tokens_per_step, self.state, self.world, device)
        self.best = BestKept(
            setup.out_dir / BEST, tp.keep_best_at, self.schedule.key, self.state["step"], self.rank, log
        )

    def run(self) -> dict:
        """Steps until the schedule's end or the time budget, then the final evaluation, checkpoint and drafter."""
        state, tp = self.state, self.tp
        if state["step"] == 0:  # the untrained drafter, for "did training help" comparisons
            state["initial_eval"] = self.timed_evaluate(in_loop=False)
            self.write_log({"step": 0, "eval": state["initial_eval"]})
            self.best.consider(state["initial_eval"] | {"at_step": 0}, self.drafter, self.setup.contract)
        stream = self.setup.source.stream(tp, state)
        started = time.time()
        self.drafter.train()
        last_eval = None
        try:  # the batch thread stops however the loop ends (a notebook keeps the failed frame alive)
            while state["step"] < self.schedule.total_steps:
                if self.schedule.over_time(state["train_seconds"] + (time.time() - started)):
                    self.log(f"time budget of {tp.max_minutes} min reached at step {state['step']}")
                    break
                last_eval = self.take_step(stream, started) or last_eval
                decided = self.schedule.after_step(state["step"], state["train_seconds"] + (time.time() - started))
                if decided:
                    self.log(decided)
                if state["step"] % tp.checkpoint_every == 0:
                    state["train_seconds"] = state["train_seconds"] + time.time() - started
                    started = time.time()
                    self.checkpoint()
        finally:
            stream.close()
        state["train_seconds"] = state["train_seconds"] + time.time() - started
        if last_eval is None or last_eval.get("at_step") != state["step"]:
            last_eval = self.evaluate_now()
        return self.finish(last_eval)

    def take_step(self, stream, started: float) -> dict | None:
        """One optimizer step on the stream's next group of micro-batches, logged; its evaluation when one is due."""
        state, tp = self.state, self.tp
        waited = time.perf_counter()
        group = [next(stream) for _ in range(tp.grad_accum * self.world)]
        state["data_wait_s"] = state.get("data_wait_s", 0.0) + time.perf_counter() - waited
        lr = self.schedule.lr(state["step"])
        step_loss, grad_norm = self.step(group, lr)
        if grad_norm is None:
            raise TrainingError(
                f"loss became {step_loss.item()} at step {state['step']}; nothing after the last good "
                f"checkpoint ({latest_checkpoint(self.ckpt_root) or 'none yet'}) was saved. Lower train.lr (now "
                f"{tp.lr}) or check the hidden-state shards for inf/nan, then rerun (resume continues from it)."
            )
        state["step"] += 1
        state["epoch"], state["micro_in_epoch"] = group[-1][0], group[-1][1] + 1
        state["sequence_in_epoch"] = group[-1][2]["next_sequence"]
        state["tokens"] += sum(mb["tokens"] for _, _, mb in group)
        elapsed = state["train_seconds"] + time.time() - started
        entry = {
            "step": state["step"],
            "loss": round(step_loss.item(), 5),
            "lr": lr,
            "grad_norm": round(grad_norm.item(), 4),
            "tokens": state["tokens"],
            "tokens_per_s": round(state["tokens"] / max(elapsed, 1e-9), 1),
        }
        self.write_log(entry)
        if state["step"] % tp.eval_every != 0 and state["step"] != self.schedule.total_steps:
            return None
        result = self.evaluate_now()
        revised = self.schedule.after_eval(state["step"], state["train_seconds"] + time.time() - started)
        if revised:
            self.log(revised)
        self.log(  # the rate so far too: a stage stopped before its summary still shows it on the console
            f"step {state['step']}/{self.schedule.total_steps} loss {entry['loss']:.4f} "
            f"est_accept_len@5 {result['est_accept_len'].get('5')} cond_acc {[round(x, 3) for x in result['cond_acc']]} "
            f"{entry['tokens_per_s']:,.0f} tokens/s"
        )
        return result

    def evaluate_now(self) -> dict:
        result = self.timed_evaluate(in_loop=True)
        result["at_step"] = self.state["step"]
        self.write_log({"step": self.state["step"], "eval": result})
        self.best.consider(result, self.drafter, self.setup.contract)
        return result

    def timed_evaluate(self, in_loop: bool) -> dict:
        """evaluate, its seconds told to the schedule (which spreads them over eval_every steps)."""
        t0 = time.perf_counter()
        result = evaluate(self.setup, self.tp.ttt_steps, self.max_depth, self.device)
        self.schedule.timed_eval(time.perf_counter() - t0, in_loop)
        return result

    def checkpoint(self):
        if self.rank != 0:
            return None
        return save_checkpoint(self.drafter, self.opt, self.state, self.ckpt_root, self.setup.contract)

    def write_log(self, entry: dict) -> None:
        if self.rank == 0:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def finish(self, last_eval: dict) -> dict:
        """The final checkpoint and drafter (rank 0), after checking every rank holds the same weights; the summary."""
        state = self.state
        digests = check_same_weights(self.drafter, self.world)
        final = self.checkpoint()
        if self.rank == 0:
            save_drafter(self.best.kept(self.drafter, last_eval), self.setup.out_dir / "drafter", self.setup.contract)
        return {
            "kept": self.best.record(last_eval),
            "last_eval": last_eval,
            "initial_eval": state.get("initial_eval"),
            "rank_weight_digests": digests,
            "steps": state["step"],
            "total_steps": self.schedule.total_steps,
            "schedule": state.get("schedule"),  # how a time budget sized it, where one did
            "tokens": state["tokens"],
            "train_seconds": round(state["train_seconds"], 1),
            "train_tokens_per_s": round(state["tokens"] / max(state["train_seconds"], 1e-9), 1),
            "data_wait_s": round(state.get("data_wait_s", 0.0), 1),  # of train_seconds, spent waiting for batches
            "final_checkpoint": str(final) if final else None,
            "eval": self.best.kept_eval(last_eval),  # the written drafter's (with keep_best_at, the best state's)
            **self.setup.source.summary(),
        }


def evaluate(setup: TrainSetup, steps: int, max_depth: int, device) -> dict:
    drafter = setup.drafter
    counter = AcceptanceCounter(steps)
    loss_sum, count = torch.zeros(steps), torch.zeros(steps)
    was_training = drafter.training
    drafter.eval()
    with torch.no_grad():
        for row in setup.val_rows:
            batch = batch_to(with_host_layout(row, steps), device)
            sums, counts, right, valid = ttt_loss_sums(drafter, batch, setup.embed, setup.head, steps)
            loss_sum += sums.float().cpu()
            count += counts.float().cpu()
            counter.update(right.cpu(), valid.cpu())
    drafter.train(was_training)
    summary = counter.summary(max_depth)
    summary["loss_per_step"] = (loss_sum / count.clamp(min=1)).tolist()
    return summary
