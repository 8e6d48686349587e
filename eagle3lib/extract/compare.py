"""Comparing two extractions of the same tokens: an engine backend against hf, per layer, and which HF layer
each of an engine's aux slots really holds (the check behind every backend's id translation).
"""

from __future__ import annotations

import torch

from eagle3lib.extract.hf import base_model, capture_hidden_states
from eagle3lib.extract.shards import ShardSet


def _tolerance(dtype):
    return {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype, 5e-2)


def compare_shard_sets(engine_dir, reference_dir, lm_head=None, rel_tol=None, chunk=2048):
    """Per-layer agreement of two extractions of the same tokens (an engine backend against hf).

    For each aux slot (our id) and the final state: max_abs (largest |a-b|), max_ref (largest |b|),
    max_rel = max_abs / max_ref, rel_rms = ||a-b|| / ||b||, min_cos (the worst token's cosine).
    With lm_head [V, H]: argmax_agree, the share of tokens whose lm_head(final) argmax is equal.
    ok: same tokens, every rel_rms <= rel_tol (default by dtype: fp32 1e-4, fp16 1e-2, bf16 5e-2).
    """
    a_set, b_set = ShardSet(engine_dir), ShardSet(reference_dir)
    ids = a_set.manifest["aux_layer_ids"]
    if ids != b_set.manifest["aux_layer_ids"]:
        raise ValueError(f"aux ids differ: {engine_dir} has {ids}, {reference_dir} {b_set.manifest['aux_layer_ids']}")
    names = [f"aux_{i}" for i in ids] + ["final"]
    acc = {n: {"max_abs": 0.0, "max_ref": 0.0, "sq_diff": 0.0, "sq_ref": 0.0, "min_cos": 1.0} for n in names}
    agree = total = 0
    seqs = 0
    for (ia, ma, aa, fa), (ib, mb, ab, fb) in zip(a_set, b_set):
        if not (torch.equal(ia, ib) and torch.equal(ma, mb)):
            raise ValueError(
                f"sequence {seqs}: the two extractions hold different tokens; compare extractions of the same inputs"
            )
        seqs += 1
        H = fa.shape[1]
        parts = [(aa[:, k * H : (k + 1) * H], ab[:, k * H : (k + 1) * H]) for k in range(len(ids))] + [(fa, fb)]
        for n, (x, y) in zip(names, parts):
            x, y = x.double(), y.double()
            d = x - y
            r = acc[n]
            r["max_abs"] = max(r["max_abs"], float(d.abs().max()))
            r["max_ref"] = max(r["max_ref"], float(y.abs().max()))
            r["sq_diff"] += float((d * d).sum())
            r["sq_ref"] += float((y * y).sum())
            r["min_cos"] = min(r["min_cos"], float(torch.nn.functional.cosine_similarity(x, y, dim=-1).min()))
        if lm_head is not None:
            w = lm_head.float()
            for s in range(0, fa.shape[0], chunk):
                la = fa[s : s + chunk].to(w.device, torch.float32) @ w.T
                lb = fb[s : s + chunk].to(w.device, torch.float32) @ w.T
                agree += int((la.argmax(-1) == lb.argmax(-1)).sum())
                total += la.shape[0]
    if seqs != len(b_set) or seqs != len(a_set):
        raise ValueError(f"{engine_dir} holds {len(a_set)} sequences, {reference_dir} {len(b_set)}; expected the same")
    dtype = next(iter(a_set))[2].dtype if len(a_set) else torch.float32
    tol = _tolerance(dtype) if rel_tol is None else rel_tol
    layers = {}
    for n in names:
        r = acc[n]
        layers[n] = {
            "max_abs": r["max_abs"],
            "max_ref": r["max_ref"],
            "max_rel": r["max_abs"] / max(r["max_ref"], 1e-30),
            "rel_rms": (r["sq_diff"] / max(r["sq_ref"], 1e-300)) ** 0.5,
            "min_cos": r["min_cos"],
        }
    out = {
        "sequences": seqs,
        "tokens": a_set.num_tokens,
        "dtype": str(dtype).removeprefix("torch."),
        "rel_tol": tol,
        "layers": layers,
        "ok": all(v["rel_rms"] <= tol for v in layers.values()),
    }
    if lm_head is not None:
        out["argmax_agree"] = agree / max(1, total)
    return out


@torch.inference_mode()
def layer_probe(model, engine_dir, aux_layer_ids, max_sequences=8):
    """Which HF layer each of an engine's aux slots really holds: rel_rms of slot k against HF
    hidden_states[i-1], [i], [i+1] (i = the id it should hold) on the first sequences. An
    off-by-one id translation shows as a best match at i-1 or i+1."""
    base = base_model(model)
    n_layers = len(base.layers)
    cands = sorted({j for i in aux_layer_ids for j in (i - 1, i, i + 1) if 0 <= j < n_layers})
    sq = {(k, j): [0.0, 0.0] for k in range(len(aux_layer_ids)) for j in cands}
    device = base.embed_tokens.weight.device
    for s, (ids, _, aux, _) in enumerate(ShardSet(engine_dir)):
        if s >= max_sequences:
            break
        ref, _ = capture_hidden_states(
            model, ids.long()[None].to(device), torch.ones(1, len(ids), dtype=torch.long, device=device), cands
        )
        ref = ref[0].double().cpu()
        H = ref.shape[1] // len(cands)
        for k in range(len(aux_layer_ids)):
            x = aux[:, k * H : (k + 1) * H].double()
            for c, j in enumerate(cands):
                y = ref[:, c * H : (c + 1) * H]
                sq[(k, j)][0] += float(((x - y) ** 2).sum())
                sq[(k, j)][1] += float((y * y).sum())
    slots = []
    for k, i in enumerate(aux_layer_ids):
        errs = {j: (sq[(k, j)][0] / max(sq[(k, j)][1], 1e-300)) ** 0.5 for j in cands if abs(j - i) <= 1}
        best = min(errs, key=errs.get)
        slots.append({"want": int(i), "best": int(best), "rel_rms": {str(j): e for j, e in errs.items()}})
    return {"slots": slots, "ok": all(x["want"] == x["best"] for x in slots)}
