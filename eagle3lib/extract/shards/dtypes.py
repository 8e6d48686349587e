"""What a shard's states are stored as: the store dtype as it is (float32, bfloat16, float16), or float8_e4m3fn
with a float32 scale per token and state, quantized where the states are (docs/design.md §4)."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
# A per token and state scale keeps a token's state at e4m3's 3 mantissa bits whatever its magnitude (hidden
# states differ in norm by orders of magnitude across tokens and layers); recorded in the manifest.
FP8_SCALING = "float32 scale per token and state: amax / 448"


def capture_dtype(store_dtype):
    """The dtype a backend hands its states over in: the store dtype, or bf16 for fp8 (quantized by the writer)."""
    return torch.bfloat16 if store_dtype == FP8 else store_dtype


def quantize(x, states, chunk_rows=8192):
    """x [n, states*H] -> (e4m3 [n, states*H], float32 scale [n, states]), each token's state scaled so that its
    largest |value| is e4m3's largest. On x's device, chunk_rows rows at a time (the fp32 copy stays small)."""
    n = x.shape[0]
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(n, states, dtype=torch.float32, device=x.device)
    for a in range(0, n, chunk_rows):
        v = x[a : a + chunk_rows].float().unflatten(-1, (states, -1))
        s = v.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny) / torch.finfo(FP8).max
        q[a : a + chunk_rows] = (v / s[..., None]).to(FP8).flatten(-2)
        scale[a : a + chunk_rows] = s
    return q, scale


def dequantize(q, scale, dtype=torch.bfloat16):
    """The inverse of quantize, for any leading shape: q [..., k*H] e4m3, scale [..., k] -> [..., k*H] dtype."""
    k = scale.shape[-1]
    return (q.unflatten(-1, (k, -1)).to(torch.float32) * scale[..., None]).flatten(-2).to(dtype)


def store_states(aux, final, n_aux, store_dtype) -> dict:
    """A shard's state tensors from a backend's aux [n, k*H] and final [n, H]: cast to the store dtype, or for
    fp8 quantized with their scales. A backend may call this on its own device and hand the dict over."""
    if store_dtype != FP8:
        return {"aux_hidden": aux.to(store_dtype), "final_hidden": final.to(store_dtype)}
    aux_q, aux_scale = quantize(aux, n_aux)
    final_q, final_scale = quantize(final, 1)
    return {"aux_hidden": aux_q, "final_hidden": final_q, "aux_scale": aux_scale, "final_scale": final_scale}


def states(t: dict, a=0, b=None, dtype=torch.bfloat16):
    """(aux, final) rows [a, b) of a shard's tensors in a compute dtype, dequantized where stored as fp8."""
    aux, final = t["aux_hidden"][a:b], t["final_hidden"][a:b]
    if "aux_scale" not in t:
        return aux, final
    return dequantize(aux, t["aux_scale"][a:b], dtype), dequantize(final, t["final_scale"][a:b], dtype)
