"""Training-time-test (TTT) training of the EAGLE-3 drafter.

Per packed row and TTT step k, position t predicts the token after t+1+k: its
target is the target model's distribution there (lm_head(final_hidden[t+1+k])
restricted to the draft vocabulary), its input the ground-truth token t+1+k and
the drafter's own hidden state from step k-1. Loss: soft cross-entropy, step k
weighted step_weight_decay**k, over positions whose predicted token is an
assistant token of the same document.

Single process or `torchrun --nproc_per_node N -m eagle3lib.train.trainer PARAMS RUN_DIR`:
rank r takes every N-th micro-batch of the same stream, gradients are summed
with all_reduce and the loss is normalized by the global count of positions,
so N processes take exactly the step one process takes with the same global batch.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from eagle3lib import hardware
from eagle3lib.drafter import Drafter, DrafterConfig
from eagle3lib.drafter.ttt_attention import row_layout
from eagle3lib.train import TrainingError, online, placement, ray_placement
from eagle3lib.train.batches import (
    batch_states,
    batch_to,
    micro_batches,
    pack_val_rows,
    shard_sequences,
)
from eagle3lib.train.checkpoint import (
    CHECKPOINTS,
    latest_checkpoint,
    resume,
    save_checkpoint,
    save_drafter,
)
from eagle3lib.train.distributed import (
    all_reduce_grads,
    check_same_weights,
    init_process_group,
    rank_and_world,
    split_capture_rank,
    trainers_joined,
    training_group,
)
from eagle3lib.train.loss import compute_dtype, linear_soft_ce, target_probs
from eagle3lib.train.metrics import AcceptanceCounter
from eagle3lib.train.optimizer import make_optimizer
from eagle3lib.train.speedups import compile_decoder_layer, convert_to_float8
from eagle3lib.train.warm_start import warm_start

# ------------------------------------------------------------------ loss ----


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
):
    """Run the TTT chain on a batch. Returns, per step: Σ over valid positions of the soft CE
    against the target's distribution on the draft vocab, the valid counts, and (with_metrics)
    whether the draft's argmax is the target's argmax over the full vocab, with the valid masks.
    fused_loss: the loss's per-chunk kernel compiled (default: on CUDA; loss.chunk_kernel).
    only_valid_rows: the lm_head scores only each step's valid positions (linear_soft_ce's only_valid;
    False scores every position, the same loss for more work: an ablation).
    A batch made with with_host_layout brings its row layout and valid rows; else they are read from the GPU."""
    ids, docs = batch["input_ids"], batch["doc_ids"]
    dtype = drafter.fc.weight.dtype
    aux, final = batch_states(batch, dtype)
    compute = compute_dtype(aux.device.type, dtype)
    with torch.no_grad():
        probs = target_probs(final, head_full[drafter.t2d].to(compute), compute)  # [B·T, V_draft]
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


# ------------------------------------------------------------ optimizer ----


def lr_at(step: int, total_steps: int, lr: float, warmup: int, final_fraction: float = 0.1) -> float:
    """Linear warmup, then cosine decay to final_fraction·lr at total_steps."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return lr * (final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


# ------------------------------------------------------------ the loop ----


@dataclass
class TrainSetup:
    """Everything the loop needs, built by the stage (build_setup) or a test."""

    drafter: Drafter
    embed: torch.Tensor  # target input embeddings [V, H] (frozen)
    head: torch.Tensor  # target lm_head [V, H_t] (frozen)
    train_sequences: callable  # (epoch, first position in its order) -> Iterator[Sequence]
    val_rows: list[dict]  # packed validation rows, each a batch of one
    contract: dict
    out_dir: Path
    inputs: dict = field(default_factory=dict)  # what identifies the training data, for resume (see run_key)
    # (train_params, loop state) -> the (epoch, index, micro-batch) stream from the state's position: a capture
    # process's (train/placement.py); None: micro_batches over train_sequences in this process
    batch_stream: callable = None
    online: object = None  # online.OnlineData when this process captures the states (its stats reach the summary)


# Train params a checkpoint resumes across: those that do not change the weights, and the budgets, so that a
# larger train.max_tokens or max_minutes continues the run (the cosine schedule stretches to the new total).
RESUME_FREE = (
    "resume",
    "max_tokens",
    "max_minutes",
    "checkpoint_every",
    "eval_every",
    "eval_max_tokens",
    "prefetch_shards",
    "batch_prefetch",
    "compile_layer",
    "online_queue_batches",
    "online_placement",  # a thread, a process or a Ray actor captures the same states into the same micro-batches
    "ray_address",
)


def run_key(setup: TrainSetup, train_params, seed: int) -> dict:
    """The params and inputs that shape a run's result: a checkpoint resumes only a run with the same key."""
    params = {k: v for k, v in train_params.model_dump().items() if k not in RESUME_FREE}
    key = {"train": params, "run": {"seed": seed}, "contract": setup.contract, "inputs": setup.inputs}
    return json.loads(json.dumps(key))  # as trainer_state.json will hold it


def tokens_sha256(tokens: dict) -> str:
    """sha256 of a token split's arrays (ids, loss mask, sequence starts)."""
    h = hashlib.sha256()
    for name in ("input_ids", "loss_mask", "seq_starts"):
        h.update(tokens[name].contiguous().numpy().tobytes())
    return h.hexdigest()


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


class TrainStep:
    """One optimizer step on a group of micro-batches: every rank is given the whole group and computes its
    share (every world-th); the loss of each TTT step k, weighted step_weight_decay**k, is normalized by the
    group's count of valid positions, so the gradients summed over ranks are those of one process."""

    def __init__(
        self, setup: TrainSetup, optimizer: torch.optim.Optimizer, train_params, device, rank: int, world: int
    ):
        self.setup, self.optimizer, self.train_params = setup, optimizer, train_params
        self.device, self.rank, self.world = device, rank, world
        self.trainable = [p for g in optimizer.param_groups for p in g["params"]]
        self.weights = torch.tensor(
            [train_params.step_weight_decay**k for k in range(train_params.ttt_steps)], device=device
        )
        self.device_type = torch.device(device).type
        self.bf16 = hardware.resolve(train_params.dtype, self.device_type) == "bfloat16"

    def __call__(self, group: list[tuple[int, int, dict]], lr: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(loss, gradient norm) of the step at learning rate lr; a non-finite loss leaves the weights as they
        were and comes back with no gradient norm."""
        train_params, device = self.train_params, self.device
        counts = torch.zeros(train_params.ttt_steps, device=device)
        for _, _, mb in group:  # global normalizer, identical on every rank without communication
            counts += torch.stack([valid_positions(mb, k).sum() for k in range(train_params.ttt_steps)]).to(device)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=device)
        for _, _, mb in group[self.rank :: self.world]:
            batch = batch_to(with_host_layout(mb, train_params.ttt_steps), device)
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
                )
            loss = (self.weights * sums / counts.clamp(min=1)).sum()
            loss.backward()
            step_loss += loss.detach()
        all_reduce_grads(self.trainable, self.world)
        if self.world > 1:
            dist.all_reduce(step_loss, group=training_group())
        if not torch.isfinite(step_loss):
            return step_loss, None
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, train_params.grad_clip)
        self.optimizer.step()
        return step_loss, grad_norm


def train(setup: TrainSetup, train_params, seed: int = 0, device="cpu", max_depth: int = 16, log=print) -> dict:
    """The TTT loop with accumulation, AdamW or Muon, warmup+cosine, clipping, checkpoints, resume, and DDP."""
    rank, world = rank_and_world()
    drafter = setup.drafter.to(device)
    setup.embed, setup.head = setup.embed.to(device), setup.head.to(device)
    if train_params.float8:
        log(f"FP8 matmuls (torchao rowwise) in {', '.join(convert_to_float8(drafter))}")
    if train_params.compile_layer:
        compile_decoder_layer(drafter)
    opt = make_optimizer(drafter, train_params.optimizer, train_params.lr, train_params.weight_decay, device)
    step = TrainStep(setup, opt, train_params, device, rank, world)
    rows_per_step = train_params.batch_rows * train_params.grad_accum * world
    total_steps = max(1, math.ceil(train_params.max_tokens / (rows_per_step * train_params.max_seq_len)))
    ckpt_root = setup.out_dir / CHECKPOINTS
    log_path = setup.out_dir / "log.jsonl"
    key = run_key(setup, train_params, seed)
    state = resume(drafter, opt, ckpt_root, log_path, device, key, train_params.resume, rank, log)

    def checkpoint():
        return save_checkpoint(drafter, opt, state, ckpt_root, setup.contract) if rank == 0 else None

    def write_log(entry):
        if rank == 0:
            with open(log_path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def evaluate_now() -> dict:
        result = evaluate(setup, train_params.ttt_steps, max_depth, device)
        result["at_step"] = state["step"]
        write_log({"step": state["step"], "eval": result})
        return result

    if state["step"] == 0:  # the untrained drafter, for "did training help" comparisons
        state["initial_eval"] = evaluate(setup, train_params.ttt_steps, max_depth, device)
        write_log({"step": 0, "eval": state["initial_eval"]})
    budget_s = (train_params.max_minutes or 0) * 60  # 0: no time budget
    stream = batch_stream(setup, train_params, state)
    started = time.time()
    drafter.train()
    last_eval = None
    try:  # the batch thread stops however the loop ends (a notebook keeps the failed frame alive)
        while state["step"] < total_steps:
            if budget_s and state["train_seconds"] + (time.time() - started) > budget_s:
                log(f"time budget of {train_params.max_minutes} min reached at step {state['step']}")
                break
            waited = time.perf_counter()
            group = [next(stream) for _ in range(train_params.grad_accum * world)]
            state["data_wait_s"] = state.get("data_wait_s", 0.0) + time.perf_counter() - waited
            lr = lr_at(state["step"], total_steps, train_params.lr, train_params.warmup_steps)
            step_loss, grad_norm = step(group, lr)
            if grad_norm is None:
                raise TrainingError(
                    f"loss became {step_loss.item()} at step {state['step']}; nothing after the last good "
                    f"checkpoint ({latest_checkpoint(ckpt_root) or 'none yet'}) was saved. Lower train.lr (now "
                    f"{train_params.lr}) or check the hidden-state shards for inf/nan, then rerun (resume "
                    "continues from it)."
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
            write_log(entry)
            if state["step"] % train_params.eval_every == 0 or state["step"] == total_steps:
                last_eval = evaluate_now()
                log(
                    f"step {state['step']}/{total_steps} loss {entry['loss']:.4f} "
                    f"est_accept_len@5 {last_eval['est_accept_len'].get('5')} cond_acc {[round(x, 3) for x in last_eval['cond_acc']]}"
                )
            if state["step"] % train_params.checkpoint_every == 0:
                state["train_seconds"] = state["train_seconds"] + time.time() - started
                started = time.time()
                checkpoint()
    finally:
        stream.close()
    state["train_seconds"] = state["train_seconds"] + time.time() - started
    if last_eval is None or last_eval.get("at_step") != state["step"]:
        last_eval = evaluate_now()
    digests = check_same_weights(drafter, world)
    final = checkpoint()
    if rank == 0:
        save_drafter(drafter, setup.out_dir / "drafter", setup.contract)
    return {
        "initial_eval": state.get("initial_eval"),
        "rank_weight_digests": digests,
        "steps": state["step"],
        "total_steps": total_steps,
        "tokens": state["tokens"],
        "train_seconds": round(state["train_seconds"], 1),
        "train_tokens_per_s": round(state["tokens"] / max(state["train_seconds"], 1e-9), 1),
        "data_wait_s": round(state.get("data_wait_s", 0.0), 1),  # of train_seconds, spent waiting for batches
        "final_checkpoint": str(final) if final else None,
        "eval": last_eval,
        **({"online": online.online_stats(setup.online)} if setup.online else {}),
    }


def batch_stream(setup: TrainSetup, train_params, state: dict):
    """The (epoch, index, micro-batch) stream from the loop state's position: nothing before it is read or
    captured. Online, the capture runs train.online_queue_batches micro-batches ahead (the queue's bound)."""
    if setup.batch_stream is not None:
        return setup.batch_stream(train_params, state)
    online = train_params.source == "online"
    return micro_batches(
        setup.train_sequences,
        train_params,
        state["epoch"],
        state["micro_in_epoch"],
        state.get("sequence_in_epoch"),  # absent from checkpoints of older versions: packed again up to the index
        depth=train_params.online_queue_batches if online else None,
    )


# -------------------------------------------------------------- the stage ----


def draft_vocab_from_tokens(train_tokens: dict, val_tokens: dict, vocab_size: int, draft_vocab_size: int):
    from eagle3lib.drafter import vocab

    counts = vocab.token_counts(train_tokens["input_ids"], train_tokens["loss_mask"], vocab_size)
    all_counts = vocab.token_counts(train_tokens["input_ids"], torch.ones_like(train_tokens["loss_mask"]), vocab_size)
    d2t, t2d = vocab.build_draft_vocab(counts, draft_vocab_size, fallback_counts=all_counts)
    val_counts = vocab.token_counts(val_tokens["input_ids"], val_tokens["loss_mask"], vocab_size)
    return (
        d2t,
        t2d,
        {
            "train_coverage": round(vocab.coverage(counts, t2d), 4),
            "val_coverage": round(vocab.coverage(val_counts, t2d), 4),
            "distinct_train_tokens": int((counts > 0).sum()),
        },
    )


def build_setup(p, run_dir: Path, device="cpu", capture=None) -> tuple[TrainSetup, dict]:
    """Everything 02_train needs from the params and the earlier stages; returns (setup, vocab stats). capture:
    the capture actor, with train.online_placement: ray; with thread, what online.load_states returned (a target
    already loaded, which this stage then captures through and leaves open), else the stage loads its own."""
    from eagle3lib import run_folder, target
    from eagle3lib.drafter import vocab
    from eagle3lib.extract.shards import ShardSet
    from eagle3lib.params import cache_dir
    from eagle3lib.prepare import conversations

    run_dir = Path(run_dir)
    prep_dir = run_dir / "00_prepare"
    run_folder.load_result(run_dir, "00_prepare")
    train_tokens, val_tokens = (
        conversations.load_tokens(prep_dir / "train.safetensors"),
        conversations.load_tokens(prep_dir / "val.safetensors"),
    )
    target_path = target.resolve_target(p.target.name, cache_dir(p))
    tcfg = target.load_config(target_path, p.target.trust_remote_code)
    tensors = target.load_head_tensors(target_path)
    train_params = p.train
    vocab_size = tensors["embed"].shape[0]
    d2t, t2d, vocab_stats = draft_vocab_from_tokens(train_tokens, val_tokens, vocab_size, train_params.draft_vocab_size)

    online_data = client = None
    if train_params.source == "shards":
        run_folder.load_result(run_dir, "01_extract")
        train_shards, val_shards = ShardSet(run_dir / "01_extract" / "train"), ShardSet(run_dir / "01_extract" / "val")
        contract = dict(train_shards.contract)
        aux_ids = contract["aux_layer_ids"]
        train_sequences = lambda epoch, start=0: shard_sequences(  # noqa: E731
            train_shards, p.run.seed, epoch, start, prefetch=p.train.prefetch_shards
        )
        val_sequences = shard_sequences(val_shards, p.run.seed, 0, shuffle=False)
    elif train_params.online_placement in ("process", "ray"):  # a capture process or actor sends the states
        info, tokenizer = target.load_target_info(target_path, cache_dir(p), p.target.trust_remote_code)
        contract = online.capture_contract(p, info, tokenizer)
        aux_ids = contract["aux_layer_ids"]
        if train_params.online_placement == "ray":
            client = ray_placement.RayCaptureClient(capture, rank_and_world()[0])
        else:
            client = placement.CaptureClient(p, contract, device)
        train_sequences = val_sequences = None
    else:
        online_data, val_data, contract = online.capture_setup(
            p, train_tokens, val_tokens, run_folder.stage_dir(run_dir, "02_train"), loaded=capture
        )
        aux_ids = contract["aux_layer_ids"]
        train_sequences, val_sequences = online_data.train_sequences, val_data.val_sequences()
    prep_contract = target.read_contract(prep_dir)
    target.check_contract(
        {k: prep_contract[k] for k in ("target_fingerprint", "vocab_size")}, contract, "the hidden states' eagle3.json"
    )
    contract.update(draft_vocab_size=train_params.draft_vocab_size, d2t_sha256=vocab.d2t_sha256(d2t))

    val_rows = client.val_rows() if client else pack_val_rows(val_sequences, train_params)
    val_tokens_used = sum(row["tokens"] for row in val_rows)
    if not val_rows:
        raise TrainingError("the validation split is empty: raise data.val_fraction so the metrics mean something")

    torch.manual_seed(p.run.seed)
    cfg = DrafterConfig.from_target(tcfg, train_params.draft_vocab_size, aux_ids)
    try:
        cfg = replace(cfg, **dict.fromkeys(train_params.eagle31_norms, True))
    except ValueError as e:
        raise TrainingError(f"train.eagle31_norms: {e}") from e
    drafter = Drafter(cfg)
    drafter.set_vocab(d2t, t2d)
    if train_params.init_lm_head_from_target:
        # The draft's last hidden state plays the target's final one: start from the target's head and norm.
        with torch.no_grad():
            drafter.lm_head.weight.copy_(tensors["lm_head"][t2d])
            drafter.norm.weight.copy_(tensors["norm"])
    if train_params.init_layer_from_target:
        layers = (getattr(tcfg, "text_config", None) or tcfg).num_hidden_layers
        drafter.init_from_target_layer(target.load_layer_tensors(target_path, layers - 1))
    warm = None
    if train_params.init_from:
        warm = warm_start(drafter, train_params.init_from, contract)
        contract.update(d2t_sha256=vocab.d2t_sha256(drafter.d2t))
        # the warm start's vocabulary replaces the one built from this run's data: its coverage of this data
        for split, tokens in (("train", train_tokens), ("val", val_tokens)):
            counts = vocab.token_counts(tokens["input_ids"], tokens["loss_mask"], vocab_size)
            vocab_stats[f"{split}_coverage"] = round(vocab.coverage(counts, drafter.t2d), 4)
    if train_params.freeze_lm_head:
        if not (train_params.init_lm_head_from_target or warm):
            raise TrainingError(
                "train.freeze_lm_head keeps lm_head as initialized, which is random unless "
                "train.init_lm_head_from_target is true: set it, or unfreeze the head"
            )
        drafter.lm_head.weight.requires_grad_(False)
    out_dir = Path(run_folder.stage_dir(run_dir, "02_train"))
    setup = TrainSetup(
        drafter=drafter,
        embed=tensors["embed"].float(),
        head=tensors["lm_head"].float(),
        train_sequences=train_sequences,
        val_rows=val_rows,
        contract=contract,
        out_dir=out_dir,
        inputs={"source": train_params.source, "train_tokens_sha256": tokens_sha256(train_tokens)},
        online=online_data,
        batch_stream=client.stream if client else None,
    )
    vocab_stats["val_tokens"] = val_tokens_used
    if warm:
        vocab_stats["warm_start"] = warm
    return setup, vocab_stats


def run_stage(params_file: str, run_dir: str, overrides: dict | None = None, capture=None) -> dict:
    """Build and train in this process (rank-aware under torchrun); writes train_summary.json on rank 0. capture:
    the capture actor a trainer actor is handed (train.online_placement: ray, ray_placement.launch), or a loaded
    capture to train online through (build_setup)."""
    from eagle3lib.params import load_params

    p = load_params(params_file, overrides)
    if p.train.source == "online" and p.train.online_placement == "ray" and capture is None:
        raise TrainingError(
            "train.online_placement: ray runs the capture and the trainers as Ray actors: start the stage with "
            "trainer.launch (the 02_train notebook and `python -m eagle3lib run` do), or set "
            "train.online_placement: thread"
        )
    device = init_process_group(p.target.device)
    if p.train.source == "online" and p.train.online_placement == "process":
        if not dist.is_initialized():
            raise TrainingError(
                "train.online_placement: process runs a capture process beside the trainers: start the stage with "
                "trainer.launch (the 02_train notebook does), or set train.online_placement: thread"
            )
        is_capture = split_capture_rank()
        placement.control_group()  # every rank makes it, in the same order
        if is_capture:
            placement.serve_capture(p, Path(run_dir), device)
            dist.barrier()
            dist.destroy_process_group()
            return {}
    rank, world = rank_and_world()
    setup, vocab_stats = build_setup(p, Path(run_dir), device, capture)
    try:
        summary = train(
            setup,
            p.train,
            p.run.seed,
            device,
            max_depth=max(16, max(p.bench.depths)),
            log=(print if rank == 0 else (lambda *a: None)),
        )
    finally:
        if setup.online and capture is None:  # an engine this stage started (its tensor-parallel ranks) stops
            setup.online.close()
    summary.update(
        vocab=vocab_stats,
        world_size=world,
        drafter_params=sum(x.numel() for x in setup.drafter.parameters()),
        # with the source, what a later run's online plan looks this run's training rate up by (train/steps.py)
        target_fingerprint=setup.contract["target_fingerprint"],
        source=p.train.source,
    )
    if rank == 0:
        (setup.out_dir / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if trainers_joined():  # the trainers and, with online_placement: process, the capture process
        dist.barrier()
        dist.destroy_process_group()
    return summary


def launch(params_file: str, run_dir: str, overrides: dict | None, nproc: int) -> dict:
    """Run the stage with torchrun when nproc > 1 (same entry point), else in this process. With
    train.online_placement: process, one more process captures the states (rank 0); with ray, Ray actors capture
    and train (ray_placement.launch: on this host, or on the cluster at RAY_ADDRESS)."""
    from eagle3lib.params import load_params

    p = load_params(params_file, overrides)
    if p.train.source == "online" and p.train.online_placement == "ray":
        return ray_placement.launch(run_stage, params_file, run_dir, overrides, nproc)
    if p.train.source == "online" and p.extract.backend == "sglang_inprocess":
        return launch_in_sglang(p, params_file, run_dir, overrides)
    if p.train.source == "online" and p.train.online_placement == "process":
        nproc += 1
    if nproc <= 1:
        return run_stage(params_file, run_dir, overrides)
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "eagle3lib.train.trainer",
        params_file,
        run_dir,
        json.dumps(overrides or {}),
    ]
    subprocess.run(cmd, check=True)
    return json.loads((Path(run_dir) / "02_train" / "train_summary.json").read_text())


def launch_in_sglang(p, params_file: str, run_dir: str, overrides: dict | None) -> dict:
    """Online with extract.backend sglang_inprocess: the stage in SGLang's interpreter (engine.python, or
    .venv-sglang), one trainer process whose thread drives SGLang's model runner. Its output is shown as it
    comes and kept in 02_train/sglang-online.log; a failure raises with the log's last lines."""
    import os
    import subprocess

    from eagle3lib import run_folder
    from eagle3lib.extract.backends import engine_settings

    engine = engine_settings(p, "sglang")
    if engine["python"] is None:
        raise FileNotFoundError(
            "train.source: online with extract.backend sglang_inprocess trains in SGLang's interpreter and none was "
            "found: set engine.name: sglang and engine.python, or build .venv-sglang (make sglang-env)"
        )
    out_dir = Path(run_folder.stage_dir(Path(run_dir), "02_train"))
    out_dir.mkdir(parents=True, exist_ok=True)
    root = str(Path(__file__).resolve().parents[2])  # so that SGLang's interpreter imports this eagle3lib
    env = dict(os.environ, **engine["env"])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("WORLD_SIZE", None)  # one trainer: SGLang's ranks make their own group
    cmd = [engine["python"], "-m", "eagle3lib.train.trainer", params_file, str(run_dir), json.dumps(overrides or {})]
    log = out_dir / "sglang-online.log"
    with (
        open(log, "w") as f,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc,
    ):
        for line in proc.stdout:
            f.write(line)
            f.flush()
            print(line, end="", flush=True)
        code = proc.wait()
    summary = out_dir / "train_summary.json"
    if code != 0 or not summary.is_file():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise TrainingError(
            f"online training in SGLang's interpreter exited {code} (checkpoints already written are kept and "
            f"resume); command: {' '.join(cmd)}\nlast lines of {log}:\n{tail}"
        )
    return json.loads(summary.read_text())


if __name__ == "__main__":  # torchrun --nproc_per_node N -m eagle3lib.train.trainer PARAMS RUN_DIR [OVERRIDES_JSON]
    run_stage(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})
