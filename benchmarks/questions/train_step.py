"""Our drafter's training step against speculators 0.9.0's: tokens/s and peak memory per row length, and DDP scaling.

Prints one JSON line of figures (config, results per length); --profile adds a kernel breakdown line.
On a GPU host: `python -m benchmarks train_step gpu-plan ablation|sweep` runs train_step.sh (speculators in
.venv-speculators, DDP over the host's GPUs).

Drafter training throughput and peak memory (one packed row per step, random hidden states).

    python -m benchmarks train_step                      # Llama-3.1-8B shape, GPU, seq 8192..131072
    python -m benchmarks train_step --small --device cpu # a dry run of the same code on the CPU
    python -m benchmarks train_step --docs tokens.safetensors --impl both --seqs 8192   # packed rows

Rows: by default one document of random tokens filling the row. With --docs, the rows real training sees: the
sequences of a prepare-stage token file (their lengths, token ids and loss masks; e.g. the embedded ShareGPT
split through SmolLM2's chat template, `python -m benchmarks.capture_check save-tokens FILE --n 600
--max-seq-len 4096`) in a seeded order, packed greedily into rows of the length as the trainer packs them
(train.batches.pack_rows: whole sequences, the rest of a row padding). --impl both runs speculators on the same
rows (its document_ids, position_ids and loss mask from the same layout).

Per sequence length: the median over --steps synchronized steps after --warmup (forward + backward + AdamW, TTT
--ttt steps, bf16 autocast on GPU) of each step's real tokens / its time, and peak memory. Steps cycle through
--steps distinct rows. A length that runs out of memory is reported as such and the sweep goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import eagle3lib  # noqa: F401  (OMP_WAIT_POLICY before torch)
from benchmarks import gpu_script
from benchmarks.drafter_shapes import LLAMA_8B, SHAPES, SMALL
from eagle3lib.drafter import Drafter, DrafterConfig
from eagle3lib.train.runtime.batches import batch_to
from eagle3lib.train.runtime.distributed import all_reduce_grads, check_same_weights
from eagle3lib.train.runtime.speedups import compile_decoder_layer, convert_to_float8
from eagle3lib.train.ttt_step import ttt_loss_sums, with_host_layout

LABELS = {"llama-8b": "llama-3.1-8b", "kimi-gqa": "kimi-k2.5 gqa", "kimi-mla": "kimi-k2.5 mla"}  # summaries' "config"


def synthetic_batch(cfg: DrafterConfig, seq: int, device, dtype, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seq + seed)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=g)
    return {
        "input_ids": ids.to(device),
        "loss_mask": torch.ones(1, seq, dtype=torch.long, device=device),
        "doc_ids": torch.zeros(1, seq, dtype=torch.long, device=device),
        "position_ids": torch.arange(seq, device=device)[None],
        "aux": torch.randn(1, seq, 3 * cfg.target_hidden_size, generator=g).to(device, dtype),
        "final": torch.randn(1, seq, cfg.target_hidden_size, generator=g).to(device, dtype),
        "tokens": seq,
    }


def packed_rows(path: str, seq: int, count: int, seed: int = 0) -> list[dict]:
    """count rows of seq tokens packed as the trainer packs them (pack_rows, make_batch) from the sequences of a
    prepare-stage token file in a seeded order: input_ids, loss_mask, doc_ids, position_ids, tokens (real ones).
    The states are left out (width 0); synthetic_states fills them."""
    from eagle3lib.prepare.conversations import load_tokens
    from eagle3lib.train.runtime.batches import Sequence, make_batch, pack_rows

    tokens = load_tokens(path)
    starts = tokens["seq_starts"].tolist()
    order = torch.randperm(len(starts) - 1, generator=torch.Generator().manual_seed(seed)).tolist()

    def sequences():
        for i in order * (1 + count * seq // max(1, starts[-1])):  # around again if the file is short
            a, b = starts[i], starts[i + 1]
            no_states = torch.empty(b - a, 0)
            yield Sequence(tokens["input_ids"][a:b].long(), tokens["loss_mask"][a:b], no_states, no_states)

    rows = []
    for row in pack_rows(sequences(), seq):
        rows.append(make_batch([row], seq))
        if len(rows) == count:
            return rows
    raise ValueError(f"{path} holds too few tokens for {count} rows of {seq}")


def synthetic_states(cfg: DrafterConfig, row: dict, device, dtype) -> dict:
    """A row of packed_rows with random aux and final states, on the device."""
    g = torch.Generator(device="cpu").manual_seed(int(row["input_ids"].sum()))
    b, seq = row["input_ids"].shape
    out = {k: v.to(device) for k, v in row.items() if k in ("input_ids", "loss_mask", "doc_ids", "position_ids")}
    out["input_ids"] = out["input_ids"] % cfg.vocab_size  # a token file of a larger vocab on the --small shape
    out["aux"] = torch.randn(b, seq, 3 * cfg.target_hidden_size, generator=g).to(device, dtype)
    out["final"] = torch.randn(b, seq, cfg.target_hidden_size, generator=g).to(device, dtype)
    out["tokens"] = row["tokens"]
    return out


def row_stats(rows: list[dict]) -> dict:
    """What the rows hold: real tokens, documents and loss-mask share per row (means)."""
    n = len(rows)
    return {
        "rows": "packed",
        "real_tokens_per_row": round(sum(r["tokens"] for r in rows) / n, 1),
        "docs_per_row": round(sum(int(r["doc_ids"].max()) + 1 for r in rows) / n, 2),
        "loss_mask_share": round(sum(int(r["loss_mask"].sum()) for r in rows) / sum(r["tokens"] for r in rows), 3),
    }


def measure(
    cfg: DrafterConfig,
    seq: int,
    ttt: int,
    steps: int,
    warmup: int,
    device: str,
    checkpoint: bool = False,
    compile_layer: bool = False,
    profile: bool = False,
    freeze_lm_head: bool = False,
    eager_loss: bool = False,
    attention: str = "auto",
    float8: bool = False,
    eager_merge: bool = False,
    rows: list[dict] | None = None,
    all_rows: bool = False,
    device_layout: bool = False,
) -> dict:
    """Median tokens/s of full training steps on rows of seq tokens (rows: packed_rows' layouts; default one
    document of random tokens), and peak memory. Under torchrun every rank runs the step on its own row and the
    gradients are all-reduced as eagle3lib.train.ttt_step does; tokens/s is then the sum over ranks.
    all_rows: the loss scores every position, valid or not (the ablation of ttt_loss_sums' only_valid_rows)."""
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0  # each rank its own rows, as data parallel has them
    torch.manual_seed(0)
    drafter = Drafter(cfg).to(device)
    d2t = torch.arange(cfg.draft_vocab_size) * (cfg.vocab_size // cfg.draft_vocab_size) - torch.arange(
        cfg.draft_vocab_size
    )
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[torch.arange(cfg.draft_vocab_size) + d2t] = True
    drafter.set_vocab(d2t.to(device), t2d.to(device))
    if float8:
        convert_to_float8(drafter, emulate=not cuda)
    if compile_layer:
        compile_decoder_layer(drafter)
    if eager_merge:  # the merged attention's merge eager although the layer is compiled (ablation)
        drafter.compile_merge = False
    drafter.lm_head.weight.requires_grad_(not freeze_lm_head)  # speculators' default: frozen
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype) * 0.02
    head = torch.randn(cfg.vocab_size, cfg.target_hidden_size, device=device, dtype=dtype) * 0.02
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=cuda)  # as eagle3lib.train.runtime.optimizer makes it
    # Rows wait on the host and each goes to the device before its step (untimed), so the peak memory is that of
    # one row's step, as in training.
    # with_host_layout: the rows' layout and valid rows made on the host, as the trainer makes them (device_layout:
    # read back from the GPU inside the step, an ablation).
    batches = (
        [synthetic_states(cfg, r, "cpu", dtype) for r in rows]
        if rows
        else [synthetic_batch(cfg, seq, "cpu", dtype, seed=rank)]
    )
    if not device_layout:
        batches = [with_host_layout(b, ttt) for b in batches]
    weights = torch.tensor([0.8**k for k in range(ttt)], device=device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def train_step(batch):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            sums, counts, _, _ = ttt_loss_sums(
                drafter,
                batch,
                embed,
                head,
                ttt,
                with_metrics=False,
                checkpoint=checkpoint,
                fused_loss=False if eager_loss else None,
                attention=attention,
                only_valid_rows=not all_rows,
            )
        loss = (weights * sums / counts.clamp(min=1)).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        all_reduce_grads(params, world)
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        return loss

    times, rates = [], []
    for i in range(warmup + steps):
        batch = None
        batch = batch_to(batches[i % len(batches)], device)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = train_step(batch)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
            rates.append(batch["tokens"] / times[-1])
    if profile:  # where one step's time goes, by kernel
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        with profiler(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            train_step(batch)
            if cuda:
                torch.cuda.synchronize()
        sort = "device_time_total" if cuda else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=70), flush=True)
        print(json.dumps({"profile": kernel_breakdown(prof, statistics.median(times), cuda)}), flush=True)
    out = {
        "seq": seq,
        "ranks": world,
        "checkpoint": checkpoint,
        "compile_layer": compile_layer,
        "freeze_lm_head": freeze_lm_head,
        "loss_kernel": "eager" if eager_loss or not cuda else "compiled",
        "attention": attention,
        "float8": float8,
        "merge_compiled": drafter.compile_merge,
        "loss_rows": "all" if all_rows else "valid",
        "layout": "device" if device_layout else "host",
        **(row_stats(rows) if rows else {"rows": "one document"}),
        "tokens_per_s": round(world * statistics.median(rates), 1),
        "step_s_median": round(statistics.median(times), 4),
        "loss": round(loss.item(), 4),
    }
    if cuda:
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if world > 1:  # data parallel must leave every rank with the same weights (check_same_weights raises if not)
        out["rank_weight_digests_equal"] = len(set(check_same_weights(drafter, world))) == 1
    return out


KERNEL_KINDS = [  # (kind, name pattern), first match wins; CUDA kernel names, or aten op names on the CPU
    ("attention", r"cudnn|fmha|flash|attention"),  # first: flash's kernel names carry cutlass types
    ("gemm", r"nvjet|gemm|cutlass|xmma|sm90_|^aten::(mm|addmm|bmm)$"),
    ("compiled (triton)", r"^triton_"),
    ("copy/cast", r"copy|convert|cast"),
    ("reduce", r"reduce|norm|softmax|sum|logsumexp"),
    ("elementwise", r"elementwise|vectorized|unrolled|index|cat|fill|mul|add|exp"),
]


def kernel_breakdown(prof, step_s: float, cuda: bool, top: int = 30) -> dict:
    """Kernel time of one profiled step by kind and the top kernels (on the CPU: ops' self time), against
    the unprofiled step time: on a GPU, kernel_ms well below step_ms means it waits on the host."""
    from torch.autograd import DeviceType

    per_name: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == (DeviceType.CUDA if cuda else DeviceType.CPU):
            rec = per_name.setdefault(e.name, [0.0, 0])
            rec[0] += (e.device_time_total if cuda else e.self_cpu_time_total) / 1000
            rec[1] += 1
    kinds: dict[str, float] = {}
    for name, (ms, _) in per_name.items():
        kind = next((k for k, pat in KERNEL_KINDS if re.search(pat, name, re.I)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + ms
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "step_ms": round(step_s * 1000, 2),
        "kernel_ms": round(sum(kinds.values()), 2),
        "by_kind_ms": {k: round(v, 2) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top": [[n[:90], round(ms, 2), calls] for n, (ms, calls) in ranked],
    }


def measure_or_oom(
    cfg,
    seq,
    ttt,
    steps,
    warmup,
    device,
    checkpoint: str,
    compile_layer: bool,
    profile: bool = False,
    freeze_lm_head: bool = False,
    eager_loss: bool = False,
    attention: str = "auto",
    float8: bool = False,
    eager_merge: bool = False,
    rows: list[dict] | None = None,
    all_rows: bool = False,
    device_layout: bool = False,
) -> dict:
    """checkpoint: "off", "on", or "auto" (off, and on again if off runs out of memory)."""
    tries = {"off": [False], "on": [True], "auto": [False, True]}[checkpoint]
    errors = []
    for ckpt in tries:
        try:
            return measure(
                cfg,
                seq,
                ttt,
                steps,
                warmup,
                device,
                checkpoint=ckpt,
                compile_layer=compile_layer,
                profile=profile,
                freeze_lm_head=freeze_lm_head,
                eager_loss=eager_loss,
                attention=attention,
                float8=float8,
                eager_merge=eager_merge,
                rows=rows,
                all_rows=all_rows,
                device_layout=device_layout,
            )
        except torch.OutOfMemoryError as e:
            errors.append(f"checkpoint={ckpt}: out of memory: {str(e).splitlines()[0]}")
        finally:
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    return {"seq": seq, "compile_layer": compile_layer, "error": "; ".join(errors)}


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu-plan"]:
        return gpu_script.plan_main("train_step", argv[1:], PLANS, "ablation")
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="a small config of the shape, for a CPU dry run")
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="llama-8b",
        help="the drafter: Llama-3.1-8B's, or Kimi-K2.5's with GQA or MLA in the draft layer (drafter_shapes.py)",
    )
    ap.add_argument("--seqs", default="8192,16384,32768,65536,131072")
    ap.add_argument("--ttt", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--checkpoint",
        choices=["off", "on", "auto"],
        default="auto",
        help="activation checkpointing per TTT step; auto = only where off runs out of memory",
    )
    ap.add_argument(
        "--compile-layer",
        action="store_true",
        help="torch.compile each TTT step's elementwise work (train.compile_layer)",
    )
    ap.add_argument("--profile", action="store_true", help="print a kernel breakdown of one step at the first length")
    ap.add_argument("--freeze-lm-head", action="store_true", help="ours with a frozen lm_head, as speculators trains")
    ap.add_argument(
        "--eager-loss", action="store_true", help="the loss's per-chunk maths eager, not compiled (ablation)"
    )
    ap.add_argument(
        "--attention",
        choices=["auto", "flex", "merged", "varlen", "dense"],
        default="auto",
        help="TTT attention (Drafter.ttt_forward); auto = merged: cuDNN on one-document rows, flash varlen on packed"
        " ones; varlen = flash varlen on any rows",
    )
    ap.add_argument(
        "--docs",
        default=None,
        metavar="TOKENS_FILE",
        help="packed rows from a prepare-stage token file's sequences (see the module docstring), both impls",
    )
    ap.add_argument("--all-rows", action="store_true", help="the loss scores every position, valid or not (ablation)")
    ap.add_argument(
        "--device-layout",
        action="store_true",
        help="the rows' layout and valid rows read back from the GPU inside the step, not made on the host (ablation)",
    )
    ap.add_argument(
        "--eager-merge",
        action="store_true",
        help="the merged attention's log-sum-exp merge eager, not compiled (ablation)",
    )
    ap.add_argument("--float8", action="store_true", help="FP8 matmuls in fc, o_proj, MLP (train.float8; torchao)")
    ap.add_argument(
        "--impl",
        choices=["ours", "speculators", "both"],
        default="ours",
        help="whose training step: ours, vLLM speculators' EAGLE-3 (benchmarks/speculators_throughput.py),"
        " or both, alternating at each length",
    )
    args = ap.parse_args(argv)
    if args.impl != "ours" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        ap.error("--impl speculators/both measures one GPU: run it without torchrun")
    rank = 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: one GPU per rank
        rank = int(os.environ["LOCAL_RANK"])
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
        if args.device.startswith("cuda"):
            args.device = f"cuda:{rank}"
            torch.cuda.set_device(args.device)
    if args.impl != "ours" and args.shape != "llama-8b":
        ap.error("--impl speculators/both measures speculators' Llama-shaped step on --shape llama-8b only")
    full, small = SHAPES[args.shape]
    cfg = DrafterConfig(**(small if args.small else full))

    def rows_of(seq: int) -> list[dict] | None:
        return packed_rows(args.docs, seq, args.steps, seed=rank) if args.docs else None

    def speculators_or_error(seq: int) -> dict:
        """speculators' step at one length; an out-of-memory (or any failure) is reported, the sweep goes on."""
        import gc
        import traceback

        from benchmarks.speculators_throughput import measure_speculators

        try:
            return measure_speculators(
                seq,
                args.ttt,
                args.steps,
                args.warmup,
                args.device,
                small=args.small,
                shape=SMALL if args.small else LLAMA_8B,
                rows=rows_of(seq),
            )
        except Exception as e:  # torch.compile can re-raise an out-of-memory wrapped in its own error
            first = (str(e).strip().splitlines() or [""])[0]
            if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
                return {"seq": seq, "error": f"out of memory: {first}"}
            traceback.print_exc()
            return {"seq": seq, "error": f"{type(e).__name__}: {first}"}
        finally:
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()

    results, spec_results = [], []
    for seq in [int(s) for s in args.seqs.split(",")]:
        if args.impl != "ours":
            spec_results.append(speculators_or_error(seq))
            print(json.dumps({"impl": "speculators", **spec_results[-1]}), flush=True)
        if args.impl == "speculators":
            continue
        r = measure_or_oom(
            cfg,
            seq,
            args.ttt,
            args.steps,
            args.warmup,
            args.device,
            args.checkpoint,
            args.compile_layer,
            profile=args.profile and rank == 0 and not results,
            freeze_lm_head=args.freeze_lm_head,
            eager_loss=args.eager_loss,
            attention=args.attention,
            float8=args.float8,
            eager_merge=args.eager_merge,
            rows=rows_of(seq),
            all_rows=args.all_rows,
            device_layout=args.device_layout,
        )
        results.append(r)
        if rank == 0:
            print(json.dumps({"impl": "ours", **r} if args.impl == "both" else r), flush=True)
    if rank == 0:
        summary = {
            "config": " ".join(
                (["small"] if args.small else [])
                + ([] if args.shape == "llama-8b" and args.small else [LABELS[args.shape]])
            ),
            "ttt_steps": args.ttt,
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        }
        if args.impl == "ours":
            summary["results"] = results
        elif args.impl == "speculators":
            summary.update(impl="speculators", results=spec_results)
        else:

            def ratio(a: dict, b: dict, key: str):
                return round(a[key] / b[key], 3) if a.get(key) and b.get(key) else None

            summary.update(
                impl="both",
                results=results,
                speculators_results=spec_results,
                ours_over_speculators=[
                    {"seq": o["seq"], "tokens_per_s": ratio(o, s, "tokens_per_s"), "peak_gib": ratio(o, s, "peak_gib")}
                    for o, s in zip(results, spec_results)
                ],
            )
        print(json.dumps(summary))
    if dist.is_initialized():
        dist.destroy_process_group()


PLANS = {"ablation": ([], {"PART": "all"}), "ablation-1": ([], {"PART": "1"}), "ablation-2": ([], {"PART": "2"}),
         "sweep": ([], {"PART": "sweep"}), "ddp": ([], {"PART": "ddp"})}  # fmt: skip


def dry_run(work: Path) -> list[str]:
    return ["--small", "--device", "cpu", "--seqs", "128", "--steps", "1", "--warmup", "1"]


def headline(rows: list[dict]) -> dict:
    last = next((r for r in reversed(rows) if "results" in r), {})
    return {f"tokens_per_s@{r['seq']}": r.get("tokens_per_s") for r in last.get("results", [])}


if __name__ == "__main__":
    sys.exit(main())
