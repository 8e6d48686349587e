"""What a 02_train run trains on: 00_prepare's tokens, the target's frozen tensors, the draft vocabulary, the
placement's source of states and its validation rows, and the drafter as the params initialize it.

    setup, vocab_stats = build_setup(p, run_dir, device)   # a loop.TrainSetup, and the vocabulary's figures
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import torch

from eagle3lib import run_folder, target
from eagle3lib.drafter import Drafter, DrafterConfig, vocab
from eagle3lib.params import cache_dir
from eagle3lib.prepare import conversations
from eagle3lib.train import TrainingError, sources
from eagle3lib.train.loop import TrainSetup
from eagle3lib.train.runtime.warm_start import warm_start


def tokens_sha256(tokens: dict) -> str:
    """sha256 of a token split's arrays (ids, loss mask, sequence starts)."""
    h = hashlib.sha256()
    for name in ("input_ids", "loss_mask", "seq_starts"):
        h.update(tokens[name].contiguous().numpy().tobytes())
    return h.hexdigest()


def draft_vocab_from_tokens(train_tokens: dict, val_tokens: dict, vocab_size: int, draft_vocab_size: int):
    """(d2t, t2d, figures): the draft vocabulary of the training split's assistant tokens, and its coverage."""
    counts = vocab.token_counts(train_tokens["input_ids"], train_tokens["loss_mask"], vocab_size)
    all_counts = vocab.token_counts(train_tokens["input_ids"], torch.ones_like(train_tokens["loss_mask"]), vocab_size)
    d2t, t2d = vocab.build_draft_vocab(counts, draft_vocab_size, fallback_counts=all_counts)
    val_counts = vocab.token_counts(val_tokens["input_ids"], val_tokens["loss_mask"], vocab_size)
    stats = {
        "train_coverage": round(vocab.coverage(counts, t2d), 4),
        "val_coverage": round(vocab.coverage(val_counts, t2d), 4),
        "distinct_train_tokens": int((counts > 0).sum()),
    }
    return d2t, t2d, stats


def prepared_tokens(run_dir: Path) -> dict:
    """00_prepare's {"train": ..., "val": ...} token splits (its result must be there)."""
    run_folder.load_result(run_dir, "00_prepare")
    prep_dir = run_dir / "00_prepare"
    return {split: conversations.load_tokens(prep_dir / f"{split}.safetensors") for split in ("train", "val")}


def build_setup(p, run_dir: Path, device="cpu", handed=None) -> tuple[TrainSetup, dict]:
    """Everything 02_train needs from the params and the earlier stages, in this process; returns (setup, vocab
    stats). handed: what this process's launcher gave it (a Ray capture actor; a capture already loaded, which the
    stage then captures through and leaves open)."""
    proc = sources.StageProcess(p, Path(run_dir), device, handed)
    return setup_for(proc, sources.for_params(p))


def setup_for(proc: sources.StageProcess, placement: sources.Placement) -> tuple[TrainSetup, dict]:
    """build_setup with the placement chosen (launch.run_stage has it already)."""
    p, run_dir, train_params = proc.p, proc.run_dir, proc.p.train
    tokens = prepared_tokens(run_dir)
    target_path = target.resolve_target(p.target.name, cache_dir(p))
    tcfg = target.load_config(target_path, p.target.trust_remote_code)
    tensors = target.load_head_tensors(target_path)
    vocab_size = tensors["embed"].shape[0]
    d2t, t2d, vocab_stats = draft_vocab_from_tokens(
        tokens["train"], tokens["val"], vocab_size, train_params.draft_vocab_size
    )
    source = placement.open(proc, tokens)
    contract = dict(source.contract)
    prep_contract = target.read_contract(run_dir / "00_prepare")
    target.check_contract(
        {k: prep_contract[k] for k in ("target_fingerprint", "vocab_size")}, contract, "the hidden states' eagle3.json"
    )
    contract.update(draft_vocab_size=train_params.draft_vocab_size, d2t_sha256=vocab.d2t_sha256(d2t))
    val_rows = source.val_rows(train_params)
    if not val_rows:
        raise TrainingError("the validation split is empty: raise data.val_fraction so the metrics mean something")
    vocab_stats["val_tokens"] = sum(row["tokens"] for row in val_rows)

    torch.manual_seed(p.run.seed)
    drafter = initial_drafter(p, tcfg, tensors, target_path, (d2t, t2d), contract["aux_layer_ids"])
    if train_params.init_from:
        warm = warm_start(drafter, train_params.init_from, contract)
        contract.update(d2t_sha256=vocab.d2t_sha256(drafter.d2t))
        # the warm start's vocabulary replaces the one built from this run's data: its coverage of this data
        for split, split_tokens in tokens.items():
            counts = vocab.token_counts(split_tokens["input_ids"], split_tokens["loss_mask"], vocab_size)
            vocab_stats[f"{split}_coverage"] = round(vocab.coverage(counts, drafter.t2d), 4)
        vocab_stats["warm_start"] = warm
    freeze(drafter, train_params)
    setup = TrainSetup(
        drafter=drafter,
        embed=tensors["embed"].float(),
        head=tensors["lm_head"].float(),
        val_rows=val_rows,
        contract=contract,
        out_dir=Path(run_folder.stage_dir(run_dir, "02_train")),
        source=source,
        inputs={"source": train_params.source, "train_tokens_sha256": tokens_sha256(tokens["train"])},
    )
    return setup, vocab_stats


def initial_drafter(p, tcfg, tensors: dict, target_path, vocab_maps: tuple, aux_ids) -> Drafter:
    """The drafter shaped for the target, with the draft vocabulary (d2t, t2d) and EAGLE-3.1's norms the params
    name; its head, norm and layer from the target's where the params say so."""
    train_params = p.train
    try:
        cfg = DrafterConfig.from_target(
            tcfg, train_params.draft_vocab_size, aux_ids, train_params.draft_attention, train_params.mla.model_dump()
        )
    except ValueError as e:
        raise TrainingError(f"train.draft_attention: {train_params.draft_attention}: {e}") from e
    try:
        cfg = replace(cfg, **dict.fromkeys(train_params.eagle31_norms, True))
    except ValueError as e:
        raise TrainingError(f"train.eagle31_norms: {e}") from e
    drafter = Drafter(cfg)
    drafter.set_vocab(*vocab_maps)
    if train_params.init_lm_head_from_target:
        # The draft's last hidden state plays the target's final one: start from the target's head and norm.
        with torch.no_grad():
            drafter.lm_head.weight.copy_(tensors["lm_head"][vocab_maps[1]])
            drafter.norm.weight.copy_(tensors["norm"])
    if train_params.init_layer_from_target:
        init_layer_from_target(drafter, tcfg, target_path)
    return drafter


def init_layer_from_target(drafter: Drafter, tcfg, target_path) -> None:
    """train.init_layer_from_target: the drafter's layer from the target's last one, where its shape maps (the
    drafter's attention names which: Drafter.init_from_target_layer). An MoE last layer is refused before its
    experts are read (Kimi-K2.5's would be ~GBs): the drafter's MLP is dense."""
    c = getattr(tcfg, "text_config", None) or tcfg
    last = c.num_hidden_layers - 1
    moe = last >= getattr(c, "first_k_dense_replace", 0) and last % (getattr(c, "moe_layer_freq", 1) or 1) == 0
    if getattr(c, "n_routed_experts", None) and moe:  # DeepSeek's rule for which layers are MoE
        raise TrainingError(
            f"train.init_layer_from_target: the target's last layer ({last}) is an MoE layer ({c.n_routed_experts} "
            "experts) and the drafter's MLP is dense, so the drafter cannot start as that layer; set it false"
        )
    try:
        drafter.init_from_target_layer(target.load_layer_tensors(target_path, last))
    except ValueError as e:
        raise TrainingError(f"train.init_layer_from_target: {e}") from e


def freeze(drafter: Drafter, train_params) -> None:
    """train.freeze_lm_head: the head stays as initialized (which must then be the target's or the warm start's)."""
    if not train_params.freeze_lm_head:
        return
    if not (train_params.init_lm_head_from_target or train_params.init_from):
        raise TrainingError(
            "train.freeze_lm_head keeps lm_head as initialized, which is random unless "
            "train.init_lm_head_from_target is true: set it, or unfreeze the head"
        )
    drafter.lm_head.weight.requires_grad_(False)
