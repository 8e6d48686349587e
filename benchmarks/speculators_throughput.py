"""The train_step.py measurement for vLLM's `speculators` (0.9.0) EAGLE-3 drafter.

    python -m benchmarks train_step --impl speculators          # Llama-3.1-8B shape, GPU
    python -m benchmarks train_step --impl both                 # speculators and ours, alternating
    python -m benchmarks train_step --small --device cpu --impl both --seqs 256 --steps 2 --warmup 1

`measure_speculators` builds speculators' own `Eagle3DraftModel` from its own config classes
(`Eagle3SpeculatorConfig`, `SpeculatorsConfig`, `VerifierConfig`, `GreedyTokenProposalConfig`) the way
`speculators train --speculator-type eagle3 --optimizer adamw --full-attention-indices 0` does
(`speculators.train.cli.create_transformer_layer_config` + `Eagle3DraftModel.from_training_args`), with
every eagle3 default of its `TrainConfig`: a llama draft decoder of 1 layer, norm_before_residual,
norm_before_fc and norm_output on, fc_norm off, frozen embed_tokens / lm_head / verifier_lm_head /
verifier_norm, `simple_flex_attention`, loss `kl_div` through the fused Triton kernels
(`loss_implementation="fused"`), ttt_step_loss_decay 1.0, AdamW lr 1e-3 weight decay 0.01 and a
linear LR schedule. The shape is train_step.py's (drafter_shapes.py: LLAMA_8B / SMALL): hidden 4096,
32 heads, 8 kv heads, head_dim 128, intermediate 14336, target vocab 128256, draft vocab 32000 (the same
regular t2d/d2t mapping as ours), 3 aux states, default RoPE theta 500000, and full causal attention
(layer_types=["full_attention"]; speculators' own default would be a 2048-token sliding window).
The verifier's weights are random (no checkpoint): `load_verifier_weights` would copy the verifier's
embedding into embed_tokens and its lm_head rows picked by t2d into both lm_head and verifier_lm_head;
here random N(0, 0.02) tensors take those places, the same values in lm_head and verifier_lm_head.

One timed step is what `speculators.train.trainer.Trainer.train_epoch` does for one batch, from the
moment the batch is on the device (no data loader, no host-to-device copy):
  * `with torch.autocast(device, dtype=bfloat16)`: `draft_tokens, loss, metrics = model(**batch,
    **train_call_kwargs)` with train_call_kwargs from `Eagle3DraftModel.get_trainer_kwargs`
    (ttt_steps=--ttt, ttt_step_loss_decay, loss_config). That forward (torch.compile'd by speculators
    itself whenever CUDA is available: `conditional_torch_compile`) builds the flex-attention block
    mask, computes the targets under no_grad as verifier_lm_head(verifier_norm(verifier last hidden
    state)) -> [1, T, 32000] logits, runs the TTT loop (ttt_steps unrolled draft passes with a
    DynamicCache that grows the keys/values by T per step and a block mask extended by a diagonal
    block per step), each step's fused KL loss against the shifted targets and its accuracy metrics;
  * `optimizer.zero_grad()`, `loss.backward()`, `clip_grad_norm_(model.parameters(), 1.0)`, the
    trainer's `error_records` metric tensor, `optimizer.step()`, `scheduler.step()`.
Left out: the trainer's per-step logging (with log_freq=1 its _StepTimer synchronizes at each phase
and every metric is read with .item()), which ours leaves out too. Parameters stay float32 under
bf16 autocast and the hidden states are bf16 on the GPU, as the single-GPU trainer has them (on the
CPU: float32, no autocast, as train_step.py's `measure`).

The batch is one packed row as speculators' data path makes it: a sample of seq + 1 random tokens
with random aux hidden states [seq + 1, 3 * hidden] and random verifier last hidden states
[seq + 1, hidden] goes through speculators' own `shift_batch` (seq tokens remain, positions 1..seq),
then gets the batch dimension, document_ids = 0 (one document, no padding) and error_records = 0 as
its collate function gives them. With train_step.py --docs the batches are its packed rows instead, laid
out as speculators' collate lays out several shifted samples (batch_of_row).

Two things differ from a plain `import speculators`, neither touching what is measured:
  * `speculators/__init__` imports every model family, and `speculators.models.eagle3.data` imports
    `speculators.train.data` only for the name `BatchType`; that data-loading module imports openai,
    datasets and hs_connectors (none on the GPU host). A stand-in module holding just
    `BatchType = dict[str, Any]` (its exact definition) is registered under that name first.
  * torch 2.11's Dynamo fails on the fused loss ("ListVariable ... already tracked for mutation"),
    see `_unshare_loss_autotuners`; the fix rebinds the two kernels, it does not change the maths.

On the CPU (a dry run) speculators compiles nothing (its `conditional_torch_compile` is a no-op without
CUDA), attention is its `--draft-attn-impl sdpa` option with a dense boolean mask (PyTorch's flex
attention has no backward on the CPU) and the loss is speculators' eager twin
(`loss_implementation="eager"`, the same KL), since its fused loss is Triton: flex attention, the
fused kernels, the autotuner fix and torch.compile only run on the GPU.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
import types
import typing

import torch

from benchmarks.drafter_shapes import LLAMA_8B, SMALL

# speculators' eagle3 defaults (speculators.train.config.schema.TrainConfig), AdamW chosen.
LR, WEIGHT_DECAY, GRAD_CLIP, TTT_STEP_LOSS_DECAY, LOSS_FN = 1e-3, 0.01, 1.0, 1.0, "kl_div"


def _import_speculators():
    """Import speculators' eagle3 training pieces without its data-loading module (see docstring)."""
    if "speculators.train.data" not in sys.modules and "speculators" not in sys.modules:
        stand_in = types.ModuleType("speculators.train.data")
        stand_in.__doc__ = "Stand-in: only BatchType, which speculators.models.eagle3.data imports."
        stand_in.BatchType = dict[str, typing.Any]
        sys.modules["speculators.train.data"] = stand_in
    import speculators
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig, shift_batch
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    return types.SimpleNamespace(
        version=getattr(speculators, "__version__", None),
        SpeculatorsConfig=SpeculatorsConfig,
        VerifierConfig=VerifierConfig,
        Eagle3DraftModel=Eagle3DraftModel,
        Eagle3SpeculatorConfig=Eagle3SpeculatorConfig,
        shift_batch=shift_batch,
        GreedyTokenProposalConfig=GreedyTokenProposalConfig,
    )


def _unshare_loss_autotuners() -> bool:
    """Give speculators' two fused-loss Triton kernels an autotuner each (torch 2.11 Dynamo fix).

    speculators/losses/fused.py decorates both `loss_forward_kernel` and `loss_backward_kernel` with
    one `_autotune_tile = triton.autotune(configs=_tile_configs(), key=["n_cols", "OP"],
    prune_configs_by={"early_config_prune": _prune_oversized_tiles})`. Each application makes its own
    `triton.runtime.autotuner.Autotuner`, but both keep the *same* list object as `.configs`. When
    Dynamo traces `_FusedLoss.apply` inside speculators' compiled forward it traces the autograd
    Function's forward and backward, meets both kernels, and wraps that shared mutable list once per
    kernel; torch 2.11's Triton HOPifier wraps `prune_configs_by` kernels' fields without Dynamo's
    side-effect de-duplication (pytorch/pytorch#177600, fixed later by #177874), so the second wrap
    fails with "ListVariable ... already tracked for mutation". Here each kernel's underlying
    `triton.jit` function (`Autotuner.fn`) is wrapped again by its own `triton.autotune` built from a
    fresh copy of the same configs with the same key and pruning function, and the module attributes
    that `_FusedLoss.forward` / `.backward` read at call time are rebound to them. Kernels, configs,
    tuning keys and pruning are unchanged, so are the results. Installed files are not edited.
    Returns whether anything was rebound (False when the two already have separate config lists).
    """
    import triton
    from speculators.losses import fused

    fwd, bwd = fused.loss_forward_kernel, fused.loss_backward_kernel
    if fwd.configs is not bwd.configs:
        return False

    def own_autotuner(kernel):
        tuned = triton.autotune(
            configs=fused._tile_configs(),
            key=list(kernel.keys),
            prune_configs_by={"early_config_prune": kernel.early_config_prune},
        )(kernel.fn)
        assert [str(c) for c in tuned.configs] == [str(c) for c in kernel.configs]
        return tuned

    fused.loss_forward_kernel = own_autotuner(fwd)
    fused.loss_backward_kernel = own_autotuner(bwd)
    assert fused.loss_forward_kernel.configs is not fused.loss_backward_kernel.configs
    return True


def build_model(spec, shape: dict, ttt: int, device: str, attn_impl: str = "simple_flex_attention"):
    """speculators' Eagle3DraftModel as `from_training_args` builds it, with random verifier weights."""
    from transformers import LlamaConfig

    # speculators.train.cli.create_transformer_layer_config (draft_arch "llama", num_layers 1,
    # --full-attention-indices 0), then from_training_args' `_attn_implementation`.
    layer = LlamaConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=1,
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        hidden_act="silu",
        max_position_embeddings=shape["max_position_embeddings"],
        initializer_range=0.02,
        rms_norm_eps=shape["rms_norm_eps"],
        head_dim=shape["head_dim"],
        tie_word_embeddings=False,
        sliding_window=2048,
        use_sliding_window=False,
        layer_types=["full_attention"],
    )
    layer.rope_parameters = dict(shape["rope_parameters"])
    layer._attn_implementation = attn_impl  # --draft-attn-impl
    config = spec.Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=shape["draft_vocab_size"],
        norm_before_residual=True,
        norm_before_fc=True,
        fc_norm=False,
        norm_output=True,
        embed_requires_grad=False,
        eagle_aux_hidden_state_layer_ids=list(shape["aux_layer_ids"]),
        speculators_config=spec.SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[spec.GreedyTokenProposalConfig(speculative_tokens=ttt)],
            default_proposal_method="greedy",
            verifier=spec.VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )
    with torch.device(device):  # built in place rather than on the CPU and moved: same model, less time
        model = spec.Eagle3DraftModel(config)
    vocab, draft = shape["vocab_size"], shape["draft_vocab_size"]
    d2t = torch.arange(draft) * (vocab // draft) - torch.arange(draft)  # the mapping of train_step.py
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.arange(draft) + d2t] = True
    model.load_vocab_mappings(t2d.to(device), d2t.to(device))
    g = torch.Generator(device="cpu").manual_seed(0)
    head = torch.randn(draft, shape["hidden_size"], generator=g) * 0.02  # the verifier lm_head's t2d rows
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.randn(vocab, shape["hidden_size"], generator=g) * 0.02)
        model.lm_head.weight.copy_(head)
        model.verifier_lm_head.weight.copy_(head)
        model.verifier_norm.weight.fill_(1.0)
    for frozen in (
        model.embed_tokens.weight,
        model.lm_head.weight,
        model.verifier_lm_head.weight,
        model.verifier_norm.weight,
    ):
        frozen.requires_grad_(False)  # as _load_verifier_weights leaves them
    return model.to(device)


def batch_of_row(row: dict, shape: dict, device: str, dtype) -> dict:
    """A packed row of train_step.packed_rows as speculators' collate lays it out after shift_batch: the
    same tokens, documents (document_ids -1 on padding) and loss mask, positions counted from 1 in each document
    (shift_batch drops each sample's first token), random hidden states of the same seed as ours."""
    g = torch.Generator(device="cpu").manual_seed(int(row["input_ids"].sum()))
    seq, hidden = row["input_ids"].shape[1], shape["target_hidden_size"]
    real = row["doc_ids"] >= 0
    batch = {
        "input_ids": row["input_ids"] % shape["vocab_size"],  # as train_step.synthetic_states
        "hidden_states": torch.randn(1, seq, 3 * hidden, generator=g).to(dtype),
        "verifier_last_hidden_states": torch.randn(1, seq, hidden, generator=g).to(dtype),
        "loss_mask": row["loss_mask"] * real,
        "position_ids": (row["position_ids"] + 1) * real,
        "document_ids": row["doc_ids"],
    }
    batch = {k: v.to(device) for k, v in batch.items()}
    batch["error_records"] = 0
    batch["tokens"] = row["tokens"]
    return batch


def synthetic_batch(spec, shape: dict, seq: int, device: str, dtype):
    """One packed row of seq tokens, through speculators' shift_batch and its collate's extra keys."""
    g = torch.Generator(device="cpu").manual_seed(seq)
    n, hidden = seq + 1, shape["target_hidden_size"]
    sample = {
        "input_ids": torch.randint(0, shape["vocab_size"], (n,), generator=g),
        "hidden_states": torch.randn(n, 3 * hidden, generator=g).to(dtype),
        "verifier_last_hidden_states": torch.randn(n, hidden, generator=g).to(dtype),
        "loss_mask": torch.ones(n, dtype=torch.long),
        "lengths": torch.tensor([n]),
        "position_ids": torch.arange(n),
    }
    shifted = spec.shift_batch(sample)
    shifted.pop("lengths")
    batch = {k: v.unsqueeze(0).to(device) for k, v in shifted.items()}
    batch["document_ids"] = torch.zeros(1, seq, dtype=torch.long, device=device)
    batch["error_records"] = 0
    batch["tokens"] = seq
    assert batch["input_ids"].shape == (1, seq) and batch["hidden_states"].shape == (1, seq, 3 * hidden)
    return batch


def measure_speculators(
    seq: int,
    ttt: int,
    steps: int,
    warmup: int,
    device: str,
    small: bool = False,
    shape: dict | None = None,
    rows: list[dict] | None = None,
) -> dict:
    """Median tokens/s (each step's real tokens over its time) of speculators' EAGLE-3 training step (module
    docstring) and peak memory, on rows (train_step.packed_rows' layouts, cycled) or one synthetic row."""
    from transformers import get_linear_schedule_with_warmup

    shape = shape or (SMALL if small else LLAMA_8B)
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    spec = _import_speculators()
    loss_implementation = "fused" if cuda else "eager"  # fused = Triton; eager = its twin, for the CPU
    attn_impl = "simple_flex_attention" if cuda else "sdpa"  # flex attention has no CPU backward
    if cuda:
        _unshare_loss_autotuners()
    # A fresh Dynamo state, as a trainer process at one fixed total_seq_len has (no recompiles
    # against another length's graphs, no automatic dynamic shapes, no recompile limit).
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(spec, shape, ttt, device, attn_impl)
    model.train()
    train_kwargs, _ = spec.Eagle3DraftModel.get_trainer_kwargs(
        ttt_steps=ttt, ttt_step_loss_decay=TTT_STEP_LOSS_DECAY, loss_fn=LOSS_FN, loss_implementation=loss_implementation
    )
    # speculators.train.optimizers.build_optimizers, optimizer "adamw"; Trainer.setup_optimizer's
    # linear schedule over the run (warm-up 1% of the steps).
    opt = torch.optim.AdamW(model.named_parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    total = warmup + steps
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=total // 100, num_training_steps=total)
    # On the host until each one's step (as train_step.measure keeps them): the peak is one row's step.
    if rows:
        batches = [batch_of_row(r, shape, "cpu", dtype) for r in rows]
    else:
        batches = [synthetic_batch(spec, shape, seq, "cpu", dtype)]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, rates = [], []
    for i in range(total):
        batch = None
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batches[i % len(batches)].items()}
        tokens = batch.pop("tokens")
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda):
            _draft_tokens, loss, metrics = model(**batch, **train_kwargs)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        metrics["error_records_sum"] = torch.tensor(batch["error_records"], dtype=torch.float32, device=loss.device)
        opt.step()
        sched.step()
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
            rates.append(tokens / times[-1])
    out = {
        "seq": seq,
        "rows": "packed" if rows else "one document",
        "tokens_per_s": round(statistics.median(rates), 1),
        "step_s_median": round(statistics.median(times), 4),
        "loss": round(loss.item(), 4),
    }
    if cuda:
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del model, opt, sched, batch, batches, loss, metrics, _draft_tokens
    torch._dynamo.reset()  # drop the compiled graphs of this length before the next measurement
    gc.collect()
    return out
