"""What each training-speed lever is worth, kernel by kernel (bf16 and fp8 GEMMs, attention paths, per layer).

Prints one JSON line of figures.

What the remaining training-speed levers are worth, measured kernel by kernel on one row (no training).

    python -m benchmarks train_levers                          # Llama-3.1-8B shape on a GPU, seq 8192
    python -m benchmarks train_levers --small --device cpu     # a dry run of the same code

One TTT step of our drafter with a frozen lm_head (the work speculators' step does) multiplies, per linear layer:
forward Y = X Wᵀ, input gradient dX = dY W, weight gradient dW = dYᵀ X (none for the frozen head), and attends
over T queries. Printed, in ms per training row of --seq tokens (--ttt steps, plus fc once):
- gemm_bf16: those matmuls in bf16, as the trainer runs them;
- gemm_fp8: the same matmuls as torch._scaled_mm in float8 e4m3 with row-wise scales (operands quantized
  beforehand), and quantize_fp8: the compiled row-wise quantization of every operand (X, Xᵀ, W, Wᵀ, dY, dYᵀ);
- attention (CUDA only): each step's flex_attention with our TTT block mask, forward + backward, against
  cuDNN's (or flash) causal scaled_dot_product_attention over step 0's keys alone, the part a kernel with
  log-sum-exp merging would hand to it (the k diagonal keys per query are O(T·k·d) on top, not timed).
fp8_saves_ms counts each quantization as a pass of its own, weights requantized every TTT step (fused into the
producers or amortized over the steps they cost less); the cuDNN figure leaves out the diagonal keys. The step's
total (train_step.py --profile) is the context.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import eagle3lib  # noqa: F401  (OMP_WAIT_POLICY before torch)

LLAMA_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, draft_vocab=32000, aux=3)
SMALL = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, draft_vocab=1024, aux=3)
E4M3 = torch.float8_e4m3fn


def linears(s: dict) -> dict:
    """(in, out, weight gradient?) of each matmul in one TTT step; fc runs once per row."""
    h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    return {
        "q_proj": (2 * h, q, True),
        "k_proj": (2 * h, kv, True),
        "v_proj": (2 * h, kv, True),
        "o_proj": (q, h, True),
        "gate_proj": (h, s["intermediate"], True),
        "up_proj": (h, s["intermediate"], True),
        "down_proj": (s["intermediate"], h, True),
        "lm_head (frozen)": (h, s["draft_vocab"], False),
    }


def timed(fn, iters: int, cuda: bool) -> float:
    """Median ms of fn() over iters calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def quantize_rows(x: torch.Tensor):
    """float8 e4m3 of x with one scale per row (amax / 448), and that scale as _scaled_mm takes it."""
    scale = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / torch.finfo(E4M3).max
    return (x / scale).to(E4M3), scale


def fp8_mm(a8, sa, b8_rows, sb):
    """a [M,K] row-major times bᵀ where b [N,K] row-major (so bᵀ is the column-major operand), scales per row."""
    return torch._scaled_mm(a8, b8_rows.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16)


def gemms(shape: dict, seq: int, ttt: int, iters: int, device: str) -> dict:
    cuda = device.startswith("cuda")
    quant = torch.compile(quantize_rows) if cuda else quantize_rows
    out = {"per_layer": {}}
    totals = {"gemm_bf16_ms": 0.0, "gemm_fp8_ms": 0.0, "quantize_fp8_ms": 0.0}
    layers = {name: (k, n, wgrad, ttt) for name, (k, n, wgrad) in linears(shape).items()}
    layers["fc (once)"] = (shape["aux"] * shape["hidden"], shape["hidden"], True, 1)
    for name, (k, n, wgrad, times) in layers.items():
        x = torch.randn(seq, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5
        dy = torch.randn(seq, n, device=device, dtype=torch.bfloat16)
        xt, wt, dyt = x.t().contiguous(), w.t().contiguous(), dy.t().contiguous()
        # the operands each product needs, row-major as _scaled_mm's first argument / transposed second
        fwd, dgrad, wgrad_ops = (x, w), (dy, wt), (dyt, xt)
        products = [fwd, dgrad] + ([wgrad_ops] if wgrad else [])
        if name.startswith("fc"):
            products = [fwd, wgrad_ops]  # the aux states need no gradient
        bf16 = sum(timed(lambda a=a, b=b: a @ b.t(), iters, cuda) for a, b in products)
        quantized = [(quant(a), quant(b)) for a, b in products]
        # the fp8 products must be the same products: relative error against bf16, ~3% for e4m3
        err = max(
            (
                (fp8_mm(qa[0], qa[1], qb[0], qb[1]).float() - (a @ b.t()).float()).norm() / (a @ b.t()).float().norm()
            ).item()
            for (a, b), (qa, qb) in zip(products, quantized)
        )
        fp8 = sum(timed(lambda qa=qa, qb=qb: fp8_mm(qa[0], qa[1], qb[0], qb[1]), iters, cuda) for qa, qb in quantized)
        operands = {id(t): t for pair in products for t in pair}.values()
        qcost = sum(timed(lambda t=t: quant(t), iters, cuda) for t in operands)
        out["per_layer"][name] = {
            "times": times,
            "bf16_ms": round(bf16, 3),
            "fp8_ms": round(fp8, 3),
            "quantize_ms": round(qcost, 3),
            "fp8_rel_err": round(err, 4),
        }
        if err > 0.1:
            raise RuntimeError(
                f"{name}: the fp8 product is {err:.1%} off the bf16 one; the operands are laid out wrong"
            )
        totals["gemm_bf16_ms"] += times * bf16
        totals["gemm_fp8_ms"] += times * fp8
        totals["quantize_fp8_ms"] += times * qcost
    out.update({k: round(v, 2) for k, v in totals.items()})
    out["fp8_saves_ms"] = round(totals["gemm_bf16_ms"] - totals["gemm_fp8_ms"] - totals["quantize_fp8_ms"], 2)
    return out


def attention(shape: dict, seq: int, ttt: int, iters: int, device: str) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from eagle3lib.drafter.ttt_attention import TTT_BLOCK, flex_attention_on_device, ttt_block_masks

    h, kvh, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    t_pad = -(-seq // TTT_BLOCK) * TTT_BLOCK
    docs = torch.zeros(1, t_pad, dtype=torch.long, device=device)
    docs[:, seq:] = -1
    masks = ttt_block_masks(docs, seq, ttt)

    def fwd_bwd(fn, q, k, v):
        def run():
            for t in (q, k, v):
                t.grad = None
            fn(q, k, v).sum().backward()

        return run

    def leaf(*size):
        return torch.randn(*size, device=device, dtype=torch.bfloat16, requires_grad=True)

    q = leaf(1, h, seq, d)
    flex_ms = 0.0
    for step in range(ttt):
        k, v = leaf(1, kvh, t_pad * (step + 1), d), leaf(1, kvh, t_pad * (step + 1), d)
        flex_ms += timed(
            fwd_bwd(
                lambda q, k, v, m=masks[step]: flex_attention_on_device(q, k, v, block_mask=m, enable_gqa=True), q, k, v
            ),
            iters,
            True,
        )
    k, v = leaf(1, kvh, seq, d), leaf(1, kvh, seq, d)
    result = {"flex_ttt_ms": round(flex_ms, 2)}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):

        def causal(q, k, v, backend=backend):
            with sdpa_kernel(backend):  # GQA as repeated heads: every backend takes that
                return F.scaled_dot_product_attention(
                    q, k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1), is_causal=True
                )

        try:
            result[f"{name}_causal_x{ttt}_ms"] = round(ttt * timed(fwd_bwd(causal, q, k, v), iters, True), 2)
        except RuntimeError as e:
            result[f"{name}_causal_x{ttt}_ms"] = f"unavailable: {str(e).splitlines()[0][:160]}"
    return result


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="a small shape, for a CPU dry run")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--ttt", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    shape = SMALL if args.small else LLAMA_8B
    result = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "shape": "small" if args.small else "llama-3.1-8b",
        "seq": args.seq,
        "ttt": args.ttt,
        **gemms(shape, args.seq, args.ttt, args.iters, args.device),
    }
    if args.device.startswith("cuda"):
        print(json.dumps(result), flush=True)  # the matmuls' figures even if attention's compiles run out of time
        result["attention"] = attention(shape, args.seq, args.ttt, args.iters, args.device)
    print(json.dumps(result))


def dry_run(work: Path) -> list[str]:
    return ["--small", "--device", "cpu", "--seq", "128", "--iters", "1"]


def headline(rows: list[dict]) -> dict:
    return {k: rows[-1].get(k) for k in ("gemm_bf16_ms", "gemm_fp8_ms", "quantize_fp8_ms") if k in rows[-1]}


if __name__ == "__main__":
    sys.exit(main())
