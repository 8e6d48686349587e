"""Drafter checkpoints: the canonical folder (config.json, model.safetensors, eagle3.json) that convert
reads, and the training checkpoints under checkpoints/step_N (the same folder plus the optimizer's and the
loop's state) that a rerun resumes from."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3lib.drafter import Drafter, DrafterConfig
from eagle3lib.drafter.digests import check_digests, damage, record_digests
from eagle3lib.run_folder import writing

CHECKPOINTS = "checkpoints"
SET_ASIDE = "checkpoints.previous"  # a run of other params or inputs, kept when a fresh one starts
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
CHECKPOINT_NAME = re.compile(r"step_(\d+)")  # whole name: step_N.tmp / step_N.old are writes a kill cut short
CHECKPOINT_FILES = ("config.json", "model.safetensors", "eagle3.json", OPTIMIZER_FILE, STATE_FILE)


class CheckpointError(RuntimeError):
    """No checkpoint of the run can be trusted: the message names each one's damaged file."""


def drafter_state(drafter: Drafter) -> dict:
    """Canonical tensor names (docs/design.md §4): layers.0.*, fc, norm, lm_head, d2t, t2d."""
    return {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}


def save_drafter(drafter: Drafter, out_dir: Path, contract: dict, extra: dict | None = None) -> Path:
    """Write the canonical checkpoint folder atomically (temp folder, then rename). A write that fails (a full disk)
    removes the temp folder, leaves any earlier out_dir as it was, and raises an OSError naming out_dir's file."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        _write_files(drafter, contract, extra or {}, tmp, out_dir)
    except Exception:  # not a Ctrl-C: as a kill, it leaves the temp folder to the next save
        shutil.rmtree(tmp, ignore_errors=True)  # its space back, for what the stage writes next
        raise
    old = out_dir.with_name(out_dir.name + ".old")
    if out_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def _write_files(drafter: Drafter, contract: dict, extra: dict, tmp: Path, out_dir: Path) -> None:
    """save_drafter's files into tmp, each write's error named by the file in out_dir (run_folder.writing: torch and
    safetensors report a full disk without the file, or in words)."""
    with writing(out_dir / "model.safetensors"):
        save_file(drafter_state(drafter), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name, obj in (("config.json", drafter.cfg.to_hf_dict()), ("eagle3.json", contract)):
        with writing(out_dir / name):
            (tmp / name).write_text(json.dumps(obj, indent=2) + "\n")
    # the state file last: a folder that has it has everything (a kill between two writes leaves no state)
    for name, obj in sorted(extra.items(), key=lambda item: not item[0].endswith(".pt")):
        with writing(out_dir / name):
            if name.endswith(".pt"):
                with open(tmp / name, "wb") as f:  # a file object: torch's own file writer says nothing of ENOSPC
                    torch.save(obj, f)
            else:
                (tmp / name).write_text(json.dumps(obj, indent=2) + "\n")
    with writing(out_dir / "sha256.json"):
        record_digests(tmp)


def load_drafter(folder: Path, device="cpu") -> Drafter:
    """The drafter of a canonical folder; its files checked against the folder's sha256.json where it has one."""
    folder = Path(folder)
    for name in ("config.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} missing: expected a canonical drafter checkpoint folder")
    check_digests(folder)
    cfg = DrafterConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    drafter = Drafter(cfg)
    state = load_file(str(folder / "model.safetensors"))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{folder}: checkpoint does not fit the drafter: missing {missing}, unexpected {unexpected}")
    return drafter.to(device)


def checkpoints(ckpt_root: Path) -> list[Path]:
    """The whole training checkpoints under ckpt_root, oldest first: folders named step_N holding every file
    a resume reads. Leftovers of a cut-short write (step_N.tmp, step_N.old, a folder without its state) are not."""
    found = []
    for path in Path(ckpt_root).glob("step_*"):
        match = CHECKPOINT_NAME.fullmatch(path.name)
        if match and all((path / name).is_file() for name in CHECKPOINT_FILES):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    done = checkpoints(ckpt_root)
    return done[-1] if done else None


def save_checkpoint(drafter: Drafter, optimizer: torch.optim.Optimizer, state: dict, ckpt_root: Path, contract: dict):
    """The drafter with the optimizer's and the loop's state as ckpt_root/step_N; only the last two are kept."""
    path = save_drafter(
        drafter,
        ckpt_root / f"step_{state['step']:07d}",
        contract,
        extra={STATE_FILE: state, OPTIMIZER_FILE: optimizer.state_dict()},
    )
    kept = checkpoints(ckpt_root)[-2:]  # the last two; anything else (older ones, cut-short writes) goes
    for old in ckpt_root.glob("step_*"):
        if old not in kept:
            shutil.rmtree(old, ignore_errors=True)
    return path


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


def run_key(setup, train_params, seed: int) -> dict:
    """The params and inputs that shape a run's result (setup: the loop's TrainSetup): a checkpoint resumes only a
    run with the same key."""
    params = {k: v for k, v in train_params.model_dump().items() if k not in RESUME_FREE}
    key = {"train": params, "run": {"seed": seed}, "contract": setup.contract, "inputs": setup.inputs}
    return json.loads(json.dumps(key))  # as trainer_state.json will hold it


def run_key_differences(saved: dict | None, current: dict) -> list[str]:
    """What differs between the run a checkpoint was made for and this one, as 'key: saved -> now' lines."""
    if saved is None:
        return ["the checkpoint records no params (written by an older version)"]
    out = []
    for section in sorted(set(saved) | set(current)):
        old, new = saved.get(section), current.get(section)
        if isinstance(old, dict) and isinstance(new, dict):
            out += [
                f"{section}.{k}: {old.get(k)!r} -> {new.get(k)!r}"
                for k in sorted(set(old) | set(new))
                if old.get(k) != new.get(k)
            ]
        elif old != new:
            out.append(f"{section}: {old!r} -> {new!r}")
    return out


def resume(
    drafter: Drafter,
    optimizer: torch.optim.Optimizer,
    ckpt_root: Path,
    log_path: Path,
    device,
    run_key: dict,
    enabled: bool = True,
    rank: int = 0,
    log=print,
) -> dict:
    """The loop's state to start from. With a checkpoint under ckpt_root made for the same run_key (the params
    and inputs that shape the result) and `enabled`: its state, its weights and optimizer state loaded in place,
    and the log's lines of later steps dropped. A checkpoint of another run_key is not resumed: rank 0 moves the
    checkpoints and log to SET_ASIDE beside them (replacing an earlier one) and says what differs. Else a fresh
    state, and rank 0 removes the older checkpoints and log (a fresh run must not mix with them)."""
    fresh = {"step": 0, "epoch": 0, "micro_in_epoch": 0, "sequence_in_epoch": 0, "tokens": 0, "train_seconds": 0.0}
    fresh["run_key"] = run_key
    latest, state, loaded = newest_good(ckpt_root, device, log) if enabled else (None, None, None)
    if latest is not None:
        differences = run_key_differences(state.get("run_key"), run_key)
        if differences:
            aside = ckpt_root.with_name(SET_ASIDE)
            log(
                f"not resuming {latest}: it was made for other params or inputs ({'; '.join(differences)}); "
                f"training starts from step 0 and the earlier checkpoints are kept in {aside}"
            )
            if rank == 0:
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(ckpt_root, aside)
                if log_path.exists():
                    os.replace(log_path, aside / log_path.name)
            return fresh
    if latest is None:
        if rank == 0 and ckpt_root.exists():
            shutil.rmtree(ckpt_root)
            log_path.unlink(missing_ok=True)
        return fresh
    resumed, optimizer_state = loaded
    drafter.load_state_dict(resumed.state_dict())
    optimizer.load_state_dict(optimizer_state)
    if rank == 0 and log_path.exists():
        log_path.write_text("".join(line + "\n" for line in log_lines_until(log_path, state["step"], log)))
    log(f"resumed from {latest} (step {state['step']}, {state['tokens']} tokens)")
    return state


def newest_good(ckpt_root: Path, device, log=print):
    """(folder, state, (drafter, optimizer state)) of the newest checkpoint whose files match their digests and
    load; a damaged newer one is passed over with a line naming its file. (None, None, None) without checkpoints;
    CheckpointError when there are some and none is good."""
    found, bad = checkpoints(ckpt_root), []
    for folder in sorted(Path(ckpt_root).glob("step_*")):
        lacking = [n for n in CHECKPOINT_FILES if not (folder / n).is_file()]
        if CHECKPOINT_NAME.fullmatch(folder.name) and folder.is_dir() and lacking:
            log(f"not resuming {folder.name}: it lacks {', '.join(lacking)} (a write cut short, or files removed)")
    for folder in reversed(found):
        try:
            wrong = damage(folder)
            if wrong is None:
                state = json.loads((folder / STATE_FILE).read_text())
                drafter = load_drafter(folder, device)
                optimizer_state = torch.load(folder / OPTIMIZER_FILE, map_location=device, weights_only=True)
        except Exception as e:  # a torn file of a checkpoint written before digests: name it, try the older one
            wrong = f"{folder} does not load ({type(e).__name__}: {e})"
        if wrong is None:
            if bad:
                log(f"resuming from the older {folder.name}: {'; '.join(bad)}")
            return folder, state, (drafter, optimizer_state)
        bad.append(wrong)
        log(f"not resuming {folder.name}: {wrong}")
    if found:
        raise CheckpointError(
            f"no checkpoint under {ckpt_root} can be trusted: {'; '.join(bad)}. Move {ckpt_root} away to train "
            "from step 0 (or set train.resume: false, which removes it)"
        )
    return None, None, None


def log_lines_until(log_path: Path, step: int, log=print) -> list[str]:
    """The training log's lines up to `step` (later steps are the checkpoint's future); a line that does not parse
    (a kill while it was written) is dropped with a note."""
    kept = []
    for number, line in enumerate(log_path.read_text().splitlines(), 1):
        try:
            entry = json.loads(line)
        except ValueError:
            log(f"{log_path}: line {number} is torn ({line[:60]!r}...), dropped")
            continue
        if entry["step"] <= step:
            kept.append(line)
    return kept


def weights_digest(module: torch.nn.Module) -> str:
    """sha256 of the module's tensors by name: equal digests, equal weights."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
