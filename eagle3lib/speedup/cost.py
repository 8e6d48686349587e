"""Which depth pays: tokens/s predicted for every depth from measured costs and acceptance (docs/design.md §5).

One speculative step at depth k verifies k+1 tokens per sequence and runs k drafter steps, so at concurrency c

    step_ms(k, c) = decode_ms[c] * (F(c*(k+1)) + k*G(c)) / F(c) + overhead_ms[c]

- decode_ms[c]: the engine's own no-speculation step, from the baseline measured in the same run;
- F(m): the target's forward over m new tokens after a cached context, G(c): the drafter's step over c tokens,
  both timed in this process on the same CPU or GPU; only their ratios are used, scaled to the engine's decode
  step. Each is the least-squares line through its timings (slope >= 0): single timings on a shared 2-core
  machine jitter by tens of ms, and a line through all of them is monotone where the raw points are not;
- overhead_ms[c]: what the engine adds per speculative step (proposer bookkeeping, rejection, per-draft-step
  launches), 0 until measured depths calibrate it (`calibrate`: the mean of what each measured depth left over).

A request spends `prefill_share` of its baseline time in prefill, which speculation does not shorten, so

    speedup(k, c) = 1 / (prefill_share + (1 - prefill_share) * step_ms(k, c) / (accept_len(k) * decode_ms[c]))

accept_len(k) = 1 + Σ_{i<k} Π_{j≤i} cond[j], from the training eval's conditional acceptance (sweep.predicted),
scaled by what the engine measured where it has measured (`calibrate`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from eagle3lib.speedup.replay import target_forward, truncate_cache


@dataclass
class Costs:
    decode_ms: dict[int, float]  # concurrency -> the engine's no-speculation step
    forward_ms: dict[int, float]  # new tokens m -> the target's forward over them (in process)
    draft_ms: dict[int, float]  # tokens c -> the drafter's step over them (in process)
    prefill_share: dict[int, float] = field(default_factory=dict)  # concurrency -> share of time in prefill
    overhead_ms: dict[int, float] = field(default_factory=dict)  # concurrency -> per speculative step
    acceptance_scale: float = 1.0  # engine-measured / training-predicted conditional acceptance
    calibrated_on: dict | None = None  # {depths, concurrency} the overhead and scale came from

    def as_dict(self) -> dict:
        return asdict(self)


def acceptance(cond_acc: list[float], depth: int, scale: float = 1.0) -> dict:
    """{accept_len, per_pos} of a chain of `depth` drafts from conditional acceptance per position (positions
    past the trained ones reuse the last), each scaled by `scale` and capped at 1."""
    cond = [min(1.0, c * scale) for c in cond_acc]
    cond += [cond[-1]] * max(0, depth - len(cond))
    per_pos, run = [], 1.0
    for c in cond[:depth]:
        run *= c
        per_pos.append(run)
    return {"accept_len": 1 + sum(per_pos), "per_pos": per_pos}


def line(points: dict[int, float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points, the slope at least 0 (a forward over
    more tokens never costs less); one point gives a flat line."""
    xs = np.array(sorted(points), dtype=float)
    ys = np.array([points[k] for k in sorted(points)], dtype=float)
    if len(xs) < 2:
        return float(ys[0]), 0.0
    slope, intercept = np.polyfit(xs, ys, 1)
    if slope < 0:
        return float(ys.mean()), 0.0
    return float(intercept), float(slope)


def step_ms(costs: Costs, depth: int, concurrency: int) -> float:
    """Predicted engine time of one speculative step at `depth` and `concurrency` (the module docstring)."""
    (f0, f1), (g0, g1) = line(costs.forward_ms), line(costs.draft_ms)
    one = f0 + f1 * concurrency
    verify = f0 + f1 * concurrency * (depth + 1)
    drafts = depth * (g0 + g1 * concurrency)
    return costs.decode_ms[concurrency] * (verify + drafts) / one + costs.overhead_ms.get(concurrency, 0.0)


def speedup(costs: Costs, concurrency: int, accept_len: float, spec_step_ms: float) -> float:
    share = costs.prefill_share.get(concurrency, 0.0)
    return 1 / (share + (1 - share) * spec_step_ms / (accept_len * costs.decode_ms[concurrency]))


def predict(costs: Costs, cond_acc: list[float], depths, concurrencies) -> list[dict]:
    """[{depth, concurrency, accept_len, step_ms, speedup}] for every depth and concurrency."""
    rows = []
    for c in concurrencies:
        for d in depths:
            acc = acceptance(cond_acc, d, costs.acceptance_scale)
            ms = step_ms(costs, d, c)
            rows.append(
                {
                    "depth": d,
                    "concurrency": c,
                    "accept_len": acc["accept_len"],
                    "step_ms": ms,
                    "speedup": speedup(costs, c, acc["accept_len"], ms),
                }
            )
    return rows


def best_depth(predicted: list[dict], concurrency: int) -> dict:
    """The predicted row with the highest speedup at `concurrency`."""
    return max((r for r in predicted if r["concurrency"] == concurrency), key=lambda r: r["speedup"])


def calibrate(costs: Costs, cond_acc: list[float], measured: list[dict]) -> Costs:
    """Costs with the engine's per-step overhead (per concurrency) and the acceptance scale fitted to every
    speculative row measured so far ({depth, concurrency, speedup, accept_len, per_pos}). A row's residual is
    the step time that gives its measured speedup at its measured acceptance, less the model's step time; the
    overhead is the mean residual per concurrency. The scale is the engine's acceptance at position 1 against
    the training eval's, averaged over the rows."""
    bare = Costs(costs.decode_ms, costs.forward_ms, costs.draft_ms)
    residuals: dict[int, list[float]] = {}
    for r in measured:
        c, x, al = r["concurrency"], r["speedup"], r.get("accept_len")
        if not al or x <= 0 or not r.get("depth"):
            continue
        share = costs.prefill_share.get(c, 0.0)
        measured_step = (1 / x - share) / (1 - share) * al * costs.decode_ms[c]
        residuals.setdefault(c, []).append(measured_step - step_ms(bare, r["depth"], c))
    overhead = dict(costs.overhead_ms) | {c: float(np.mean(v)) for c, v in residuals.items()}
    first = [r["per_pos"][0] for r in measured if r.get("per_pos")]
    scale = float(np.mean(first)) / cond_acc[0] if first and cond_acc[0] > 0 else costs.acceptance_scale
    return Costs(
        costs.decode_ms,
        costs.forward_ms,
        costs.draft_ms,
        costs.prefill_share,
        overhead,
        scale,
        {"depths": sorted({r["depth"] for r in measured if r.get("depth")}), "concurrency": sorted(residuals)},
    )


def measured_step_ms(costs: Costs, row: dict) -> float:
    """The engine's speculative step time that a measured row's speedup and acceptance length imply."""
    c = row["concurrency"]
    share = costs.prefill_share.get(c, 0.0)
    return (1 / row["speedup"] - share) / (1 - share) * row["accept_len"] * costs.decode_ms[c]


def accept_len_for(costs: Costs, concurrency: int, spec_step_ms: float, target_speedup: float) -> float:
    """The acceptance length a speculative step of `spec_step_ms` needs to reach `target_speedup` (inf where the
    prefill share alone keeps it out of reach)."""
    share = costs.prefill_share.get(concurrency, 0.0)
    room = 1 / target_speedup - share
    if room <= 0:
        return float("inf")
    return (1 - share) * spec_step_ms / (room * costs.decode_ms[concurrency])


def limits(costs: Costs, row: dict, target_speedup: float = 1.5) -> dict:
    """What bounds one measured speculative row ({depth, concurrency, speedup, accept_len}): its step in decode
    steps, split into the verify forward, the drafter's steps and what the engine adds beyond the model (None
    without in-process timings); the
    speedup the same step would give if every draft were accepted (accept_len = depth + 1); the acceptance
    length `target_speedup` needs at this step time (None where prefill alone keeps it out of reach); and the cap
    that prefill alone sets (None without prefill). The limiting factor is
    acceptance when all drafts accepted would reach the target at this step cost, else the step's cost."""
    d, c = row["depth"], row["concurrency"]
    decode = costs.decode_ms[c]
    measured = measured_step_ms(costs, row)
    verify = drafts = None  # without in-process timings (no cost model) the step is not split
    if costs.forward_ms and costs.draft_ms:
        bare = Costs(costs.decode_ms, costs.forward_ms, costs.draft_ms)
        (g0, g1), (f0, f1) = line(costs.draft_ms), line(costs.forward_ms)
        drafts = decode * d * (g0 + g1 * c) / (f0 + f1 * c)
        verify = step_ms(bare, d, c) - drafts
    share = costs.prefill_share.get(c, 0.0)
    ceiling = speedup(costs, c, d + 1, measured)
    needed = accept_len_for(costs, c, measured, target_speedup)
    return {
        "depth": d,
        "concurrency": c,
        "speedup": row["speedup"],
        "accept_len": row["accept_len"],
        "step_decode_steps": measured / decode,
        "verify_decode_steps": None if verify is None else verify / decode,
        "drafts_decode_steps": None if drafts is None else drafts / decode,
        "engine_decode_steps": None if verify is None else (measured - verify - drafts) / decode,
        "prefill_share": share,
        "prefill_cap": 1 / share if share > 0 else None,  # None: no cap
        "all_accepted_speedup": ceiling,
        "target_speedup": target_speedup,
        "accept_len_needed": None if needed == float("inf") else needed,  # None: out of reach
        "limited_by": "acceptance" if ceiling >= target_speedup else "step cost",
    }


# ------------------------------------------------------------------------- measurement ----


def decode_costs(baseline_rows: list[dict]) -> tuple[dict[int, float], dict[int, float]]:
    """(decode_ms, prefill_share) per concurrency from the baseline's rows: the step time is the wall time
    per token of each in-flight sequence, c * 1000 / tokens_per_s, less the prefill share the engine's own
    counters report (rows' prefill_s and decode_s, where the engine has them)."""
    decode, share = {}, {}
    for r in baseline_rows:
        c = r["concurrency"]
        s = 0.0
        if r.get("prefill_s") and r.get("decode_s"):
            s = r["prefill_s"] / (r["prefill_s"] + r["decode_s"])
        share[c] = s
        decode[c] = (1 - s) * c * 1000 / r["tokens_per_s"]
    return decode, share


def _best_ms(fn, repeats: int, device) -> float:
    """Best wall time of fn() in ms over `repeats` after a warm-up, waiting for the GPU where there is one."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return 1000 * best


@torch.inference_mode()
def forward_costs(model, drafter, context: int, tokens: list[int], repeats: int = 5) -> tuple[dict, dict]:
    """(forward_ms, draft_ms): the target's forward over m new tokens after `context` cached ones, and the
    drafter's step over m tokens after as many, for each m in `tokens`; best of `repeats`. m tokens of one
    sequence cost what one token each of m sequences costs (the same matmuls; each attends to a context)."""
    from transformers import DynamicCache

    from eagle3lib.drafter import DraftCache

    device = model.get_input_embeddings().weight.device
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (context + max(tokens),)).tolist()
    cache = DynamicCache()
    target_forward(model, ids[:context], cache)
    dtype = drafter.fc.weight.dtype
    hidden = drafter.cfg.hidden_size

    def target(m):
        target_forward(model, ids[context : context + m], cache)
        truncate_cache(cache, context)

    def draft_inputs(start, n):
        """(embeds, the draft's own hidden state, positions) of n tokens from `start`: random, as only time counts."""
        pos = torch.arange(start, start + n, device=device)[None]
        return (
            torch.randn(1, n, hidden, dtype=dtype, device=device),
            torch.randn(1, n, hidden, dtype=dtype, device=device),
            pos,
        )

    context_cache = DraftCache()
    drafter.step(context_cache, *draft_inputs(0, context), from_target=False)

    def draft_step(m):
        """A chain step (the draft's own hidden state in, no fc) over m tokens after `context` cached ones."""
        inputs = draft_inputs(context, m)
        return lambda: drafter.step(_copy(context_cache), *inputs, from_target=False)

    forward = {m: _best_ms(lambda m=m: target(m), repeats, device) for m in tokens}
    draft = {m: _best_ms(draft_step(m), repeats, device) for m in tokens}
    return forward, draft


def _copy(cache):
    """A DraftCache holding the same entries, so a timed step appends to a context of the same length each time."""
    from eagle3lib.drafter import DraftCache

    out = DraftCache()
    out.keys, out.values, out.positions = cache.keys, cache.values, cache.positions
    return out
