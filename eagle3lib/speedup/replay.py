"""Where each generated token came from: greedy EAGLE-3 speculative decoding replayed with our drafter.

The engines only report counts. To colour a generated text by how each token came, this module runs the
same algorithm they run, with our drafter (`Drafter.step` + `DraftCache`, the KV-cache chain) against the
Hugging Face target, one sequence at a time:

- prefill: the target reads the prompt; its greedy token is the first output token;
- each verify step: the drafter proposes `depth` tokens (its first step reads the target's aux states of
  the tokens verified last, later steps its own hidden state); the target scores the last committed
  token and the drafts in one forward; drafts are accepted while they equal the target's greedy token
  at their position; the target's token after the last accepted one is appended (a "bonus" token).

The output is therefore the target's greedy decoding, token for token (tests/e2e/test_provenance.py checks it
against one-token-at-a-time decoding and `generate`). Each token carries a source: k in 1..depth = the draft
token accepted at chain position k; 0 (TARGET) = the target's own token (prefill or verification).
Acceptance length = 1 + accepted drafts / verify steps, which is what vLLM reports (docs/design.md §5), and
per_pos[k] = verify steps whose first k+1 drafts were accepted / verify steps (= joint_acc[k]).
"""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from eagle3lib import run_folder
from eagle3lib.drafter import DraftCache, Drafter

TARGET = 0  # source of a token the target produced itself


# ------------------------------------------------------------------------------ target side ----


def _one_cpu_thread(fn):
    """Run with one torch thread when the target is on the CPU (restored afterwards): a verify step multiplies
    a few rows at a time, and on a busy 2-core machine two threads made such matmuls ~25x slower
    (6x576 @ 576x1536: 6.6 ms against 0.25 ms; a 96-token replay at depth 5: 114 s against 10 s)."""

    @functools.wraps(fn)
    def wrapper(model, *args, **kwargs):
        if model.get_input_embeddings().weight.device.type != "cpu":
            return fn(model, *args, **kwargs)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(model, *args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return wrapper


def _base(model):
    base = getattr(model, "model", None)
    if base is None or getattr(base, "layers", None) is None:
        raise TypeError(
            f"expected a Hugging Face causal LM with model.model.layers (Llama-like), found "
            f"{type(model).__name__}; load the target with eagle3lib.target.load_target"
        )
    return base


@torch.inference_mode()
def target_forward(model, ids: list[int], cache, aux_layer_ids: list[int] | None = None):
    """Run the target's decoder on `ids` after what `cache` (a transformers DynamicCache) holds, appending to it.
    Returns (final hidden states [len(ids), H] after the final norm: the lm_head of row i gives the logits at
    i, see `greedy_at`; aux states [1, len(ids), 3H] or None). Aux ids use HF hidden_states indexing: id i =
    the input of decoder layer i (docs/design.md §4)."""
    base = _base(model)
    captured, handles = {}, []

    def keep(k):
        def hook(module, args, kwargs):
            captured[k] = args[0] if args else kwargs["hidden_states"]

        return hook

    for k, i in enumerate(aux_layer_ids or []):
        handles.append(base.layers[int(i)].register_forward_pre_hook(keep(k), with_kwargs=True))
    accepts = inspect.signature(base.forward).parameters
    kwargs = {"cache" if "cache" in accepts else "past_key_values": cache, "use_cache": True}
    device = model.get_input_embeddings().weight.device
    try:
        out = base(input_ids=torch.tensor([ids], device=device), **kwargs)
    finally:
        for h in handles:
            h.remove()
    aux = torch.cat([captured[k] for k in range(len(aux_layer_ids))], -1) if aux_layer_ids else None
    return out.last_hidden_state[0], aux


def greedy_at(model, hidden_row) -> int:
    """The target's greedy token from one final hidden state (its lm_head, only where it is needed: a verify
    step stops at the first rejected draft)."""
    return int(model.get_output_embeddings()(hidden_row).argmax())


def truncate_cache(cache, length: int) -> None:
    """Drop a DynamicCache's entries after the first `length` positions."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _truncate_draft(cache: DraftCache, length: int) -> None:
    """Drop the draft cache's entries after the first `length` (the chain steps of the last proposal)."""
    cache.keys, cache.values = cache.keys[:, :, :length], cache.values[:, :, :length]
    cache.positions = cache.positions[:, :length]


@_one_cpu_thread
@torch.inference_mode()
def greedy_decode(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The target's greedy continuation, one token per forward with a KV cache (the no-speculation reference)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    hidden, _ = target_forward(model, list(prompt_ids), cache)
    out = [greedy_at(model, hidden[-1])]
    while len(out) < max_tokens:
        hidden, _ = target_forward(model, [out[-1]], cache)
        out.append(greedy_at(model, hidden[-1]))
    return out


# ----------------------------------------------------------------------------- the replay ----


@_one_cpu_thread
@torch.inference_mode()
def speculative_decode(
    model, drafter: Drafter, prompt_ids: list[int], depth: int, max_tokens: int, prefill: dict | None = None
) -> dict:
    """Greedy speculative decoding of `max_tokens` tokens (no stop at EOS, as the benchmark's ignore_eos) with a
    chain of `depth` drafts per verify step. Returns {token_ids, source, rounds, accepted, accept_len, per_pos}.

    prefill: the result of `prefill_prompt` for this prompt, to share one prompt forward between depths
    (its target cache is truncated back to the prompt afterwards)."""
    if depth < 1 or max_tokens < 1:
        raise ValueError(f"expected depth >= 1 and max_tokens >= 1, got depth={depth}, max_tokens={max_tokens}")
    prompt_ids = [int(i) for i in prompt_ids]
    n = len(prompt_ids)
    pre = prefill or prefill_prompt(model, drafter, prompt_ids)
    cache = pre["cache"]
    truncate_cache(cache, n)
    embed = model.get_input_embeddings().weight
    dtype = drafter.fc.weight.dtype

    def embeds(tokens):
        return embed[torch.tensor(tokens, device=embed.device)][None].to(dtype)

    out, source = [pre["first"]], [TARGET]
    draft_cache = DraftCache()
    # The drafter reads the target's aux state at position p with the token at p + 1.
    aux, positions, next_tokens = pre["aux"].to(dtype), list(range(n)), prompt_ids[1:] + [pre["first"]]
    rounds, accepted = 0, [0] * depth
    while len(out) < max_tokens:
        hidden, logits = drafter.step(
            draft_cache, embeds(next_tokens), aux, torch.tensor([positions], device=embed.device), from_target=True
        )
        kept = draft_cache.positions.shape[1]
        drafts = [int(drafter.draft_to_target(logits[0, -1].argmax()))]
        hidden, p = hidden[:, -1:], positions[-1]
        for _ in range(depth - 1):
            p += 1
            hidden, logits = drafter.step(
                draft_cache, embeds(drafts[-1:]), hidden, torch.tensor([[p]], device=embed.device), from_target=False
            )
            drafts.append(int(drafter.draft_to_target(logits[0, -1].argmax())))
        _truncate_draft(draft_cache, kept)

        start = n + len(out) - 1  # position of the last committed token
        verify = [out[-1]] + drafts
        hidden, verify_aux = target_forward(model, verify, cache, drafter.cfg.aux_layer_ids)
        a, token = 0, greedy_at(model, hidden[0])  # the target's token after the last committed one
        while a < depth and drafts[a] == token:
            a += 1
            token = greedy_at(model, hidden[a])
        new = drafts[:a] + [token]
        truncate_cache(cache, start + a + 1)  # keep the committed token and the accepted drafts
        rounds += 1
        for k in range(a):
            accepted[k] += 1
        out += new
        source += list(range(1, a + 1)) + [TARGET]
        aux, positions, next_tokens = verify_aux[:, : a + 1].to(dtype), list(range(start, start + a + 1)), new
    truncate_cache(cache, n)
    return {
        "token_ids": out[:max_tokens],
        "source": source[:max_tokens],
        "rounds": rounds,
        "accepted": sum(accepted),
        "accept_len": 1 + sum(accepted) / rounds if rounds else None,
        "per_pos": [x / rounds for x in accepted] if rounds else [],
    }


@_one_cpu_thread
@torch.inference_mode()
def prefill_prompt(model, drafter: Drafter, prompt_ids: list[int]) -> dict:
    """The target's forward over the prompt: {cache, first (greedy token), aux [1, n, 3H]}."""
    from transformers import DynamicCache

    cache = DynamicCache()
    hidden, aux = target_forward(model, [int(i) for i in prompt_ids], cache, drafter.cfg.aux_layer_ids)
    return {"cache": cache, "first": greedy_at(model, hidden[-1]), "aux": aux}


def replay_dtype(bench_dtype: str | None, target_dtype: str, device: str) -> str:
    """The dtype to replay in: the benchmark's when it forces one; on the CPU float32 (as fast as bf16 there,
    and the only dtype in which a verify step and one-token decoding round alike, so depths do not drift
    apart); on accelerators the target's."""
    return bench_dtype or ("float32" if str(device).startswith("cpu") else target_dtype)


# ------------------------------------------------------------------------------ for reports ----


def prompt_texts(bench_prompts: list[dict]) -> dict:
    """{id: the last user turn} of the prepare stage's bench prompts ({id, messages})."""
    return {
        b["id"]: next((m["content"] for m in reversed(b["messages"]) if m["role"] == "user"), "") for b in bench_prompts
    }


def token_pieces(tokenizer, token_ids: list[int]) -> list[str]:
    """The text each token adds, decoded incrementally; a character split over several byte tokens is given
    to the token that completes it (the others get ""), so the pieces join to the decoded text."""
    pieces, emitted = [], ""
    for i in range(len(token_ids)):
        text = tokenizer.decode(token_ids[: i + 1])
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence so far
            pieces.append("")
        elif text.startswith(emitted):
            pieces.append(text[len(emitted) :])
            emitted = text
        else:  # decoding rewrote earlier text (rare): fall back to the token alone
            pieces.append(tokenizer.decode(token_ids[i : i + 1]))
            emitted += pieces[-1]
    final = tokenizer.decode(token_ids)
    if pieces and final.startswith(emitted):
        pieces[-1] += final[len(emitted) :]
    return pieces


@_one_cpu_thread
def replay_prompts(
    model,
    tokenizer,
    drafter: Drafter,
    prompts: list[dict],
    depths: list[int],
    max_tokens: int,
    baseline: list[dict] | None = None,
    texts: dict | None = None,
    progress: bool = True,
) -> dict:
    """Replay every prompt ({id, prompt_ids}) at every depth; texts: {id: the prompt as a reader should see it}
    (default: the end of the templated prompt). baseline: the engine's no-speculation outputs
    ({id, token_ids, text}, same order) shown beside the replay and compared with it token for token.

    Returns {depths, max_tokens, prompts: [{id, prompt, baseline, replays: {depth: {...}}}], summary: {depth: {...}}}:
    each replay has token_ids, pieces (the text of each token), source, rounds, accept_len, per_pos and
    equals_baseline; summary[depth] pools the prompts (accept_len = 1 + accepted / verify steps)."""
    base = {b["id"]: b for b in (baseline or [])}
    records = []
    bar = tqdm(total=len(prompts) * len(depths), desc="replay", unit="run", disable=not progress)
    for pr in prompts:
        pre = prefill_prompt(model, drafter, pr["prompt_ids"])
        b = base.get(pr["id"])
        rec = {
            "id": pr["id"],
            "prompt": (texts or {}).get(pr["id"]) or tokenizer.decode(pr["prompt_ids"][-200:]),
            "baseline": b and {"token_ids": b["token_ids"], "pieces": token_pieces(tokenizer, b["token_ids"])},
            "replays": {},
        }
        for d in depths:
            r = speculative_decode(model, drafter, pr["prompt_ids"], d, max_tokens, prefill=pre)
            r["pieces"] = token_pieces(tokenizer, r["token_ids"])
            r["equals_baseline"] = None if b is None else r["token_ids"] == b["token_ids"]
            rec["replays"][str(d)] = r
            bar.update(1)
        records.append(rec)
    bar.close()
    summary = {}
    for d in depths:
        rs = [rec["replays"][str(d)] for rec in records]
        rounds = sum(r["rounds"] for r in rs)
        per_pos = [sum(r["per_pos"][k] * r["rounds"] for r in rs) / rounds if rounds else 0.0 for k in range(d)]
        summary[str(d)] = {
            "accept_len": 1 + sum(r["accepted"] for r in rs) / rounds if rounds else None,
            "per_pos": per_pos,
            "rounds": rounds,
            "tokens_from_drafts": sum(1 for r in rs for s in r["source"] if s != TARGET),
            "tokens": sum(len(r["token_ids"]) for r in rs),
            "equals_baseline": None if not base else sum(bool(r["equals_baseline"]) for r in rs),
        }
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return {
        "depths": list(depths),
        "max_tokens": max_tokens,
        "target_dtype": dtype,
        "prompts": records,
        "summary": summary,
    }


def compare_with_engine(prov: dict, rows: list[dict]) -> list[dict]:
    """Per depth: the replay's acceptance beside the engine's measured one (its lowest concurrency) and the
    training's prediction, and how many replayed outputs equal the engine's no-speculation output."""
    out = []
    for d in prov["depths"]:
        s = prov["summary"][str(d)]
        engine = min((r for r in rows if r["depth"] == d), key=lambda r: r["concurrency"], default={})
        out.append(
            {
                "depth": d,
                "replay accept len": s["accept_len"],
                "engine accept len": engine.get("accept_len"),
                "engine concurrency": engine.get("concurrency"),
                "predicted (training)": engine.get("predicted_accept_len"),
                "replay per position": " ".join(f"{x:.2f}" for x in s["per_pos"]),
                "engine per position": " ".join(f"{x:.2f}" for x in engine.get("per_pos") or []),
                "tokens from drafts": f"{s['tokens_from_drafts']} of {s['tokens']}",
                "equal to the baseline": (
                    None if s["equals_baseline"] is None else f"{s['equals_baseline']} of {len(prov['prompts'])}"
                ),
            }
        )
    return out


def save(path, prov: dict) -> Path:
    """Write the replay record atomically (05_benchmark/provenance.json; the widget and the report read it)."""
    path = Path(path)
    run_folder.write_json(path, prov)
    return path


def load(path) -> dict:
    if not Path(path).is_file():
        raise FileNotFoundError(f"Expected the token provenance {path}, found none; rerun the benchmark stage.")
    return json.loads(Path(path).read_text())
