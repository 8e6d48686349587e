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

import dataclasses
import json
import math
import os
import queue
import random
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from eagle3lib.drafter import Drafter, DrafterConfig
from eagle3lib.train.loss import compute_dtype, linear_soft_ce, target_probs
from eagle3lib.train.metrics import AcceptanceCounter

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite loss, bad inputs); the message says what to change."""


# ------------------------------------------------------------------ data ----


@dataclass
class Sequence:
    input_ids: torch.Tensor  # [n] int
    loss_mask: torch.Tensor  # [n] uint8
    aux: torch.Tensor  # [n, 3H_t]
    final: torch.Tensor  # [n, H_t]


def pack_rows(sequences: Iterator[Sequence], max_seq_len: int) -> Iterator[list[Sequence]]:
    """Greedy packing of whole sequences (truncated to max_seq_len): the sequences of each row of at most
    max_seq_len tokens (make_batch lays rows out)."""
    row: list[Sequence] = []
    used = 0
    for seq in sequences:
        n = min(len(seq.input_ids), max_seq_len)
        if row and used + n > max_seq_len:
            yield row
            row, used = [], 0
        row.append(Sequence(seq.input_ids[:n], seq.loss_mask[:n], seq.aux[:n], seq.final[:n]))
        used += n
    if row:
        yield row


def make_batch(rows: list[list[Sequence]], length: int) -> dict:
    """A micro-batch [B, length, ...] of packed rows, each row's padding at its end (doc_ids -1, zeros elsewhere).
    Each state is copied once, straight into place: at 4.6 KB a token (SmolLM2) a concatenate-pad-stack
    pipeline made three copies and held an H200's training steps waiting."""
    b, first = len(rows), rows[0][0]
    long = dict(dtype=torch.long)
    batch = {
        "input_ids": torch.zeros(b, length, **long),
        "loss_mask": torch.zeros(b, length, **long),
        "doc_ids": torch.full((b, length), -1, **long),
        "position_ids": torch.zeros(b, length, **long),
        "aux": torch.empty(b, length, first.aux.shape[-1], dtype=first.aux.dtype),
        "final": torch.empty(b, length, first.final.shape[-1], dtype=first.final.dtype),
    }
    tokens = 0
    for r, row in enumerate(rows):
        at = 0
        for d, s in enumerate(row):
            n = len(s.input_ids)
            for key, value in (
                ("input_ids", s.input_ids),
                ("loss_mask", s.loss_mask),
                ("aux", s.aux),
                ("final", s.final),
            ):
                batch[key][r, at : at + n] = value
            batch["doc_ids"][r, at : at + n] = d
            batch["position_ids"][r, at : at + n] = torch.arange(n)
            at += n
        batch["aux"][r, at:] = 0
        batch["final"][r, at:] = 0
        tokens += at
    batch["tokens"] = tokens
    return batch


def epoch_order(num_items: int, seed: int, epoch: int) -> list[int]:
    order = list(range(num_items))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def shard_sequences(shards, seed: int, epoch: int, shuffle: bool = True, prefetch: int = 0) -> Iterator[Sequence]:
    """Sequences of a ShardSet, shards and sequences within a shard in a seeded order per epoch.

    prefetch: shards loaded ahead in threads (reading and sha256 release the GIL). On an H200 a 1.2 GB
    shard took ~3 s to load and ~1.7 s to train on: without it the GPU idled for over half the run."""
    order = epoch_order(len(shards.shards), seed, epoch) if shuffle else list(range(len(shards.shards)))
    with ThreadPoolExecutor(max(1, prefetch)) as pool:
        pending = deque(pool.submit(shards.load, i) for i in order[:prefetch])
        for j, i in enumerate(order):
            t = pending.popleft().result() if pending else shards.load(i)
            if prefetch and j + prefetch < len(order):
                pending.append(pool.submit(shards.load, order[j + prefetch]))
            starts = t["seq_starts"].tolist()
            spans = list(zip(starts[:-1], starts[1:]))
            if shuffle:
                random.Random(seed * 7919 + epoch * 31 + i).shuffle(spans)
            for a, b in spans:
                yield Sequence(t["input_ids"][a:b], t["loss_mask"][a:b], t["aux_hidden"][a:b], t["final_hidden"][a:b])


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
):
    """Run the TTT chain on a batch. Returns, per step: Σ over valid positions of the soft CE
    against the target's distribution on the draft vocab, the valid counts, and (with_metrics)
    whether the draft's argmax is the target's argmax over the full vocab, with the valid masks.
    fused_loss: the loss's per-chunk kernel compiled (default: on CUDA; loss.chunk_kernel)."""
    ids, docs = batch["input_ids"], batch["doc_ids"]
    dtype = drafter.fc.weight.dtype
    aux, final = batch["aux"].to(dtype), batch["final"].to(dtype)
    compute = compute_dtype(aux.device.type, dtype)
    with torch.no_grad():
        probs = target_probs(final, head_full[drafter.t2d].to(compute), compute)  # [B·T, V_draft]
        # The full-vocab argmax costs as much as a target lm_head; only metrics need it.
        target_best = target_argmax(final.float(), head_full.float()) if with_metrics else None
    # Step k at t is fed token t+1+k: one tensor of the next tokens, K-1 longer, serves all steps.
    embeds = F.embedding(F.pad(ids[:, 1:], (0, steps)), embed).to(dtype)
    hidden = drafter.ttt_forward(aux, embeds, batch["position_ids"], docs, attention=attention, checkpoint=checkpoint)
    sums, counts, rights, valids = [], [], [], []
    for k in range(steps):
        valid = valid_positions(batch, k)
        loss, best = linear_soft_ce(
            drafter.norm(hidden[k]), drafter.lm_head.weight, probs, valid, offset=1 + k, dtype=compute, fused=fused_loss
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


# ----------------------------------------------------------- checkpoints ----


def drafter_state(drafter: Drafter) -> dict:
    """Canonical tensor names (DESIGN.md §4): layers.0.*, fc, norm, lm_head, d2t, t2d."""
    return {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}


def save_drafter(drafter: Drafter, out_dir: Path, contract: dict, extra: dict | None = None) -> Path:
    """Write the canonical checkpoint folder atomically (temp folder, then rename)."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(drafter_state(drafter), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(drafter.cfg.to_hf_dict(), indent=2) + "\n")
    (tmp / "eagle3.json").write_text(json.dumps(contract, indent=2) + "\n")
    for name, obj in (extra or {}).items():
        if name.endswith(".pt"):
            torch.save(obj, tmp / name)
        else:
            (tmp / name).write_text(json.dumps(obj, indent=2) + "\n")
    old = out_dir.with_name(out_dir.name + ".old")
    if out_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def load_drafter(folder: Path, device="cpu") -> Drafter:
    folder = Path(folder)
    for name in ("config.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} missing: expected a canonical drafter checkpoint folder")
    cfg = DrafterConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    drafter = Drafter(cfg)
    state = load_file(str(folder / "model.safetensors"))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{folder}: checkpoint does not fit the drafter: missing {missing}, unexpected {unexpected}")
    return drafter.to(device)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    done = sorted(
        (p for p in Path(ckpt_root).glob("step_*") if (p / STATE_FILE).is_file()),
        key=lambda p: int(p.name.split("_")[1]),
    )
    return done[-1] if done else None


# ------------------------------------------------------------ the loop ----


@dataclass
class TrainSetup:
    """Everything the loop needs, built by the stage (see stage_setup) or a test."""

    drafter: Drafter
    embed: torch.Tensor  # target input embeddings [V, H] (frozen)
    head: torch.Tensor  # target lm_head [V, H_t] (frozen)
    train_sequences: callable  # epoch -> Iterator[Sequence]
    val_rows: list[dict]  # packed validation rows, each a batch of one
    contract: dict
    out_dir: Path


def weights_digest(module: torch.nn.Module) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def all_reduce_grads(params: list, world: int) -> None:
    """Sum the gradients over ranks (data parallel); all requests in flight at once."""
    if world <= 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for work in [dist.all_reduce(p.grad, async_op=True) for p in params]:
        work.wait()


def compile_decoder_layer(drafter: Drafter) -> None:
    """torch.compile the elementwise-heavy parts of a TTT step (norm, q/k/v sum, rotary; MLP with its
    SiLU·up; the merged attention's merge; the output norm before the loss), fusing what would otherwise
    be separate passes over [T, 14336]-sized activations. Bound methods are replaced, so parameter names
    stay as they were."""
    layer = drafter.layer
    layer.step_qkv = torch.compile(layer.step_qkv)
    layer.self_attn.output = torch.compile(layer.self_attn.output)  # with train.float8: o_proj's input scaling fused
    layer.finish = torch.compile(layer.finish)
    drafter.norm.forward = torch.compile(drafter.norm.forward)
    drafter.compile_merge = True


FLOAT8_MODULES = ("fc", "o_proj", "gate_proj", "up_proj", "down_proj")


def convert_to_float8(drafter: Drafter, emulate: bool = False) -> list[str]:
    """Train fc, o_proj and the MLP with FP8 matmuls (e4m3, row-wise dynamic scales: torchao's "rowwise"
    recipe): forward and both backward GEMMs at FP8 rate, master weights, optimizer and checkpoint as
    before. q/k/v run as two bf16 GEMMs of weight halves (Drafter.ttt_forward) and lm_head inside the
    fused loss, so they stay bf16. emulate: FP8 numerics without FP8 hardware (tests). Returns the names."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise RuntimeError("train.float8 needs torchao: pip install 'eagle3-workbook[fp8]' (or torchao)") from e
    if not emulate and not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
        raise RuntimeError(
            "train.float8 needs a GPU with FP8 matmuls (compute capability ≥ 8.9: Ada, Hopper, "
            "Blackwell); set train.float8: false here"
        )
    config = Float8LinearConfig.from_recipe_name("rowwise")
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    converted = []

    def wanted(module, name):
        if name.split(".")[-1] in FLOAT8_MODULES and module.in_features % 16 == 0 and module.out_features % 16 == 0:
            converted.append(name)
            return True
        return False

    convert_to_float8_training(drafter, config=config, module_filter_fn=wanted)
    return converted


def _dist_info():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def micro_batches(setup: TrainSetup, tp, start_epoch: int, skip: int) -> Iterator[tuple[int, int, dict]]:
    """(epoch, index in epoch, micro-batch) for the whole stream, skipping `skip` of the first epoch;
    made tp.batch_prefetch batches ahead in a background thread (the copies release the GIL)."""
    return in_background(_micro_batches(setup, tp, start_epoch, skip), tp.batch_prefetch)


def _micro_batches(setup: TrainSetup, tp, start_epoch: int, skip: int) -> Iterator[tuple[int, int, dict]]:
    epoch = start_epoch
    while True:
        rows = pack_rows(setup.train_sequences(epoch), tp.max_seq_len)
        index, chunk = 0, []
        for row in rows:
            chunk.append(row)
            if len(chunk) == tp.batch_rows:
                if index >= skip:
                    yield epoch, index, make_batch(chunk, tp.max_seq_len)
                index, chunk = index + 1, []
        if index == 0 and skip == 0:
            raise TrainingError("the training data yields no full batch: lower train.batch_rows or add data")
        epoch, skip = epoch + 1, 0


class _Raised:
    def __init__(self, error: BaseException):
        self.error = error


def in_background(items: Iterator, depth: int) -> Iterator:
    """The items of an iterator, in order, made up to `depth` ahead in a daemon thread; an error raised
    there is raised here. Closing this generator stops the thread and closes `items` there."""
    if depth <= 0:
        yield from items
        return
    made, stop, end = queue.Queue(depth), threading.Event(), object()

    def put(x) -> bool:
        while not stop.is_set():
            try:
                made.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work():
        try:
            for x in items:
                if not put(x):
                    return
            put(end)
        except BaseException as e:  # noqa: BLE001 (re-raised in the consumer)
            put(_Raised(e))
        finally:
            close = getattr(items, "close", None)
            if close:
                close()

    worker = threading.Thread(target=work, name="eagle3-batches", daemon=True)
    worker.start()
    try:
        while True:
            x = made.get()
            if x is end:
                return
            if isinstance(x, _Raised):
                raise x.error
            yield x
    finally:
        stop.set()
        worker.join()


def evaluate(setup: TrainSetup, steps: int, max_depth: int, device) -> dict:
    drafter = setup.drafter
    counter = AcceptanceCounter(steps)
    loss_sum, count = torch.zeros(steps), torch.zeros(steps)
    was_training = drafter.training
    drafter.eval()
    with torch.no_grad():
        for row in setup.val_rows:
            batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in row.items()}
            sums, counts, right, valid = ttt_loss_sums(drafter, batch, setup.embed, setup.head, steps)
            loss_sum += sums.float().cpu()
            count += counts.float().cpu()
            counter.update(right.cpu(), valid.cpu())
    drafter.train(was_training)
    summary = counter.summary(max_depth)
    summary["loss_per_step"] = (loss_sum / count.clamp(min=1)).tolist()
    return summary


def train(setup: TrainSetup, tp, seed: int = 0, device="cpu", max_depth: int = 16, log=print) -> dict:
    """The TTT loop with accumulation, AdamW, warmup+cosine, clipping, checkpoints, resume, and DDP."""
    rank, world = _dist_info()
    drafter = setup.drafter.to(device)
    embed, head = setup.embed.to(device), setup.head.to(device)
    setup.embed, setup.head = embed, head
    params = [p for p in drafter.parameters() if p.requires_grad]
    if tp.float8:
        log(f"FP8 matmuls (torchao rowwise) in {', '.join(convert_to_float8(drafter))}")
    if tp.compile_layer:
        compile_decoder_layer(drafter)
    # fused: one CUDA kernel for the whole update instead of a foreach chain (same maths)
    opt = torch.optim.AdamW(
        params, lr=tp.lr, betas=(0.9, 0.95), weight_decay=tp.weight_decay, fused=torch.device(device).type == "cuda"
    )
    rows_per_step = tp.batch_rows * tp.grad_accum * world
    total_steps = max(1, math.ceil(tp.max_tokens / (rows_per_step * tp.max_seq_len)))
    weights = torch.tensor([tp.step_weight_decay**k for k in range(tp.ttt_steps)], device=device)
    ckpt_root = setup.out_dir / CHECKPOINTS
    log_path = setup.out_dir / "log.jsonl"
    use_bf16 = tp.dtype == "bfloat16" or (tp.dtype == "auto" and torch.device(device).type == "cuda")
    autocast_device = torch.device(device).type

    state = {"step": 0, "epoch": 0, "micro_in_epoch": 0, "tokens": 0, "train_seconds": 0.0}
    latest = latest_checkpoint(ckpt_root) if tp.resume else None
    if latest is not None:
        resumed = load_drafter(latest, device)
        drafter.load_state_dict(resumed.state_dict())
        opt.load_state_dict(torch.load(latest / OPTIMIZER_FILE, map_location=device, weights_only=True))
        state = json.loads((latest / STATE_FILE).read_text())
        if rank == 0 and log_path.exists():  # drop log lines of steps the checkpoint does not hold
            lines = [line for line in log_path.read_text().splitlines() if json.loads(line)["step"] <= state["step"]]
            log_path.write_text("".join(line + "\n" for line in lines))
        log(f"resumed from {latest} (step {state['step']}, {state['tokens']} tokens)")
    elif rank == 0 and ckpt_root.exists():
        shutil.rmtree(ckpt_root)  # a fresh run (resume off) must not mix with older checkpoints
        log_path.unlink(missing_ok=True)

    def checkpoint():
        if rank != 0:
            return
        path = save_drafter(
            drafter,
            ckpt_root / f"step_{state['step']:07d}",
            setup.contract,
            extra={STATE_FILE: state, OPTIMIZER_FILE: opt.state_dict()},
        )
        for old in sorted(ckpt_root.glob("step_*"))[:-2]:  # keep the last two
            shutil.rmtree(old, ignore_errors=True)
        return path

    def write_log(entry):
        if rank == 0:
            with open(log_path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    if state["step"] == 0:  # the untrained drafter, for "did training help" comparisons
        state["initial_eval"] = evaluate(setup, tp.ttt_steps, max_depth, device)
        write_log({"step": 0, "eval": state["initial_eval"]})
    stream = micro_batches(setup, tp, state["epoch"], state["micro_in_epoch"])
    started = time.time()
    drafter.train()
    last_eval = None
    try:  # the batch thread stops however the loop ends (a notebook keeps the failed frame alive)
        while state["step"] < total_steps:
            if tp.max_minutes and state["train_seconds"] + (time.time() - started) > tp.max_minutes * 60:
                log(f"time budget of {tp.max_minutes} min reached at step {state['step']}")
                break
            # Everyone sees the step's micro-batches; each rank computes its share.
            waited = time.perf_counter()
            micro = [next(stream) for _ in range(tp.grad_accum * world)]
            state["data_wait_s"] = state.get("data_wait_s", 0.0) + time.perf_counter() - waited
            mine = micro[rank::world]
            counts = torch.zeros(tp.ttt_steps, device=device)
            for _, _, mb in micro:  # global normalizer, identical on every rank without communication
                counts += torch.stack([valid_positions(mb, k).sum() for k in range(tp.ttt_steps)]).to(device)
            lr = lr_at(state["step"], total_steps, tp.lr, tp.warmup_steps)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            step_loss = torch.zeros((), device=device)
            for _, _, mb in mine:
                batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in mb.items()}
                with torch.autocast(autocast_device, dtype=torch.bfloat16, enabled=use_bf16):
                    sums, _, _, _ = ttt_loss_sums(
                        drafter,
                        batch,
                        embed,
                        head,
                        tp.ttt_steps,
                        with_metrics=False,
                        checkpoint=tp.activation_checkpointing,
                        attention=tp.attention,
                    )
                loss = (weights * sums / counts.clamp(min=1)).sum()
                loss.backward()
                step_loss += loss.detach()
            all_reduce_grads(params, world)
            if world > 1:
                dist.all_reduce(step_loss)
            if not torch.isfinite(step_loss):
                last = latest_checkpoint(ckpt_root)
                raise TrainingError(
                    f"loss became {step_loss.item()} at step {state['step']}; nothing after the last good "
                    f"checkpoint ({last or 'none yet'}) was saved. Lower train.lr (now {tp.lr}) or "
                    f"check the hidden-state shards for inf/nan, then rerun (resume continues from it)."
                )
            grad_norm = torch.nn.utils.clip_grad_norm_(params, tp.grad_clip)
            opt.step()
            state["step"] += 1
            state["epoch"], state["micro_in_epoch"] = micro[-1][0], micro[-1][1] + 1
            state["tokens"] += sum(mb["tokens"] for _, _, mb in micro)
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
            if state["step"] % tp.eval_every == 0 or state["step"] == total_steps:
                last_eval = evaluate(setup, tp.ttt_steps, max_depth, device)
                last_eval["at_step"] = state["step"]
                write_log({"step": state["step"], "eval": last_eval})
                log(
                    f"step {state['step']}/{total_steps} loss {entry['loss']:.4f} "
                    f"est_accept_len@5 {last_eval['est_accept_len'].get('5')} cond_acc {[round(x, 3) for x in last_eval['cond_acc']]}"
                )
            if state["step"] % tp.checkpoint_every == 0:
                state["train_seconds"] = state["train_seconds"] + time.time() - started
                started = time.time()
                checkpoint()
    finally:
        stream.close()
    state["train_seconds"] = state["train_seconds"] + time.time() - started
    if last_eval is None or last_eval.get("at_step") != state["step"]:
        last_eval = evaluate(setup, tp.ttt_steps, max_depth, device)
        last_eval["at_step"] = state["step"]
        write_log({"step": state["step"], "eval": last_eval})
    digests = [weights_digest(drafter)]
    if world > 1:  # data parallel must leave every rank with the same weights
        digests = [None] * world
        dist.all_gather_object(digests, weights_digest(drafter))
        if len(set(digests)) != 1:
            raise TrainingError(f"ranks hold different weights after training: {digests}")
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
    }


# -------------------------------------------------------------- the stage ----


def draft_vocab_from_tokens(train_tokens: dict, val_tokens: dict, vocab_size: int, draft_vocab_size: int):
    from eagle3lib import vocab

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


def online_sequences(model, tokens: dict, aux_layer_ids, seed: int, epoch: int, shuffle: bool = True):
    """Sequences with the target's states computed now (train.source: online), one forward each."""
    from eagle3lib.extract.shards import capture_hidden_states

    starts = tokens["seq_starts"].tolist()
    order = epoch_order(len(starts) - 1, seed, epoch) if shuffle else range(len(starts) - 1)
    device = next(model.parameters()).device
    for s in order:
        ids = tokens["input_ids"][starts[s] : starts[s + 1]].long()
        aux, final = capture_hidden_states(
            model, ids[None].to(device), torch.ones(1, len(ids), dtype=torch.long, device=device), aux_layer_ids
        )
        yield Sequence(ids, tokens["loss_mask"][starts[s] : starts[s + 1]], aux[0].cpu(), final[0].cpu())


def build_setup(p, run_dir: Path, device="cpu") -> tuple[TrainSetup, dict]:
    """Everything 02_train needs from the params and the earlier stages; returns (setup, vocab stats)."""
    from eagle3lib import run_folder, target, vocab
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
    from transformers import AutoConfig

    tcfg = AutoConfig.from_pretrained(target_path, trust_remote_code=p.target.trust_remote_code)
    tensors = target.load_head_tensors(target_path)
    tp = p.train
    vocab_size = tensors["embed"].shape[0]
    d2t, t2d, vocab_stats = draft_vocab_from_tokens(train_tokens, val_tokens, vocab_size, tp.draft_vocab_size)

    if tp.source == "shards":
        run_folder.load_result(run_dir, "01_extract")
        train_shards, val_shards = ShardSet(run_dir / "01_extract" / "train"), ShardSet(run_dir / "01_extract" / "val")
        contract = dict(train_shards.contract)
        aux_ids = contract["aux_layer_ids"]
        train_sequences = lambda epoch: shard_sequences(  # noqa: E731
            train_shards, p.run.seed, epoch, prefetch=p.train.prefetch_shards
        )
        val_sequences = shard_sequences(val_shards, p.run.seed, 0, shuffle=False)
    else:
        model, tokenizer = target.load_target(
            p.target.name,
            cache_dir(p),
            dtype=p.target.dtype,
            device=p.target.device,
            trust_remote_code=p.target.trust_remote_code,
        )
        layers = target.num_layers(model.config)
        aux_ids = target.check_aux_layer_ids(p.target.aux_layer_ids or target.default_aux_layer_ids(layers), layers)
        contract = target.make_contract(p.target.name, model, tokenizer, aux_ids, p.target.dtype)
        train_sequences = lambda epoch: online_sequences(model, train_tokens, aux_ids, p.run.seed, epoch)  # noqa: E731
        val_sequences = online_sequences(model, val_tokens, aux_ids, p.run.seed, 0, shuffle=False)
    prep_contract = target.read_contract(prep_dir)
    target.check_contract(
        {k: prep_contract[k] for k in ("target_fingerprint", "vocab_size")}, contract, "the hidden states' eagle3.json"
    )
    contract.update(draft_vocab_size=tp.draft_vocab_size, d2t_sha256=vocab.d2t_sha256(d2t))

    val_rows, val_tokens_used = [], 0
    for row in pack_rows(val_sequences, tp.max_seq_len):
        if val_tokens_used >= tp.eval_max_tokens:
            break
        val_rows.append(make_batch([row], tp.max_seq_len))
        val_tokens_used += val_rows[-1]["tokens"]
    if not val_rows:
        raise TrainingError("the validation split is empty: raise data.val_fraction so the metrics mean something")

    torch.manual_seed(p.run.seed)
    cfg = DrafterConfig.from_target(tcfg, tp.draft_vocab_size, aux_ids)
    drafter = Drafter(cfg)
    drafter.set_vocab(d2t, t2d)
    if tp.init_lm_head_from_target:
        # The draft's last hidden state plays the target's final one: start from the target's head and norm.
        with torch.no_grad():
            drafter.lm_head.weight.copy_(tensors["lm_head"][t2d])
            drafter.norm.weight.copy_(tensors["norm"])
    if tp.freeze_lm_head:
        if not tp.init_lm_head_from_target:
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
    )
    vocab_stats["val_tokens"] = val_tokens_used
    return setup, vocab_stats


def run_stage(params_file: str, run_dir: str, overrides: dict | None = None) -> dict:
    """Build and train in this process (rank-aware under torchrun); writes train_summary.json on rank 0."""
    from eagle3lib.params import load_params

    p = load_params(params_file, overrides)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    device = p.target.device
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(device)
        dist.init_process_group(backend)
    setup, vocab_stats = build_setup(p, Path(run_dir), device)
    summary = train(
        setup,
        p.train,
        p.run.seed,
        device,
        max_depth=max(16, max(p.bench.depths)),
        log=(print if rank == 0 else (lambda *a: None)),
    )
    summary.update(
        vocab=vocab_stats, world_size=world, drafter_params=sum(x.numel() for x in setup.drafter.parameters())
    )
    if rank == 0:
        (setup.out_dir / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return summary


def launch(params_file: str, run_dir: str, overrides: dict | None, nproc: int) -> dict:
    """Run the stage with torchrun when nproc > 1 (same entry point), else in this process."""
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


if __name__ == "__main__":  # torchrun --nproc_per_node N -m eagle3lib.train.trainer PARAMS RUN_DIR [OVERRIDES_JSON]
    run_stage(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})
