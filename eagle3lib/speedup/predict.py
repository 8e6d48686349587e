"""The training stage's acceptance estimate, on the benchmark's own prompts and replies, per prompt set.

Each benchmark sequence (a prompt and the target's greedy reply, from the no-speculation baseline) becomes a
row exactly as a validation row is made (batches.make_batch of one document, loss mask on the reply), with
the target's hidden states computed here, and runs through the same TTT evaluation (ttt_step.ttt_loss_sums,
metrics.AcceptanceCounter). So the estimate per set sits beside the acceptance the engines measure on the
same sets, with no difference of data between them. As in training, step 0 also scores the first reply token,
which an engine takes from the prefill, not from a draft.

    per_set = predict_per_set(model, drafter, sequences, drafter.cfg.aux_layer_ids, steps=p.train.ttt_steps)
    predicted_for(per_set, "mt_bench", 5)   # estimated acceptance length at depth 5, or None
"""

from __future__ import annotations

import torch

from eagle3lib.extract.hf import capture_hidden_states
from eagle3lib.extract.shards import plan_batches
from eagle3lib.target import check_aux_layer_ids, num_layers
from eagle3lib.train.metrics import AcceptanceCounter
from eagle3lib.train.runtime.batches import Sequence, make_batch
from eagle3lib.train.ttt_step import ttt_loss_sums

ALL = "all"


def _check(sequences: list[dict], aux_layer_ids, model, drafter, steps) -> None:
    """Refuse what would give a silently wrong estimate, before any forward."""
    if steps is None:
        raise ValueError(
            "steps: the drafter checkpoint does not record its TTT steps (they are in the params, train.ttt_steps, "
            "and in 02_train/train_summary.json as eval.trained_steps); pass steps="
        )
    if not sequences:
        raise ValueError("no sequences to predict on")
    ids = check_aux_layer_ids([int(i) for i in aux_layer_ids], num_layers(model.config))
    if ids != list(drafter.cfg.aux_layer_ids):
        raise ValueError(f"aux_layer_ids {ids} are not the drafter's {list(drafter.cfg.aux_layer_ids)}")
    for s in sequences:
        if s["set"] == ALL:
            raise ValueError(f"sequence {s['id']!r}: set name {ALL!r} is taken by the total over every set")
        if not s["token_ids"]:
            raise ValueError(f"sequence {s['id']!r} of set {s['set']!r} has an empty reply: nothing to predict")


def _rows(model, sequences: list[dict], aux_layer_ids, batch_tokens: int):
    """(sequence, validation row) for each sequence: states from right-padded forwards of at most batch_tokens
    padded tokens (as the hf extraction batches them), each sequence then its own row of one document."""
    ids = [torch.tensor(s["prompt_ids"] + s["token_ids"], dtype=torch.long) for s in sequences]
    lengths = [len(x) for x in ids]
    for group in plan_batches(lengths, range(len(ids)), batch_tokens):
        width = lengths[group[0]]  # longest first
        batch = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for b, s in enumerate(group):
            batch[b, : lengths[s]], mask[b, : lengths[s]] = ids[s], 1
        aux, final = capture_hidden_states(model, batch, mask, aux_layer_ids)
        for b, s in enumerate(group):
            n, prompt = lengths[s], len(sequences[s]["prompt_ids"])
            loss_mask = torch.zeros(n, dtype=torch.uint8)
            loss_mask[prompt:] = 1
            seq = Sequence(ids[s], loss_mask, aux[b, :n].cpu(), final[b, :n].cpu())
            yield sequences[s], make_batch([[seq]], n)


def predict_per_set(
    model,
    drafter,
    sequences: list[dict],
    aux_layer_ids,
    max_depth: int = 16,
    steps: int | None = None,
    device="cpu",
    batch_tokens: int = 4096,
) -> dict:
    """{set: training-eval summary} over sequences [{"id", "set", "prompt_ids", "token_ids"}], plus "all".

    Each summary is AcceptanceCounter.summary(max_depth) (step_acc, cond_acc, joint_acc, est_accept_len,
    positions = valid positions at step 0, ...) with loss_per_step as loop.evaluate adds it, "sequences",
    and "accept_len_at" {depth: estimated acceptance length} for depths 1..max_depth. steps: the TTT steps
    (the drafter's train.ttt_steps; required, the checkpoint does not record them). The target's states stay
    in its dtype, as online training keeps them; ttt_loss_sums casts them to the drafter's. The drafter is
    moved to device; the target stays where it is."""
    _check(sequences, aux_layer_ids, model, drafter, steps)
    drafter = drafter.to(device)
    embed = model.get_input_embeddings().weight.detach().float().to(device)  # as build_setup reads them
    head = model.get_output_embeddings().weight.detach().float().to(device)
    tally = {}  # set -> AcceptanceCounter, loss sums, valid counts, sequences
    was_training = drafter.training
    drafter.eval()
    try:
        with torch.no_grad():
            for s, row in _rows(model, sequences, aux_layer_ids, batch_tokens):
                batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in row.items()}
                sums, counts, right, valid = ttt_loss_sums(drafter, batch, embed, head, steps)
                for name in (s["set"], ALL):
                    t = tally.setdefault(name, [AcceptanceCounter(steps), torch.zeros(steps), torch.zeros(steps), 0])
                    t[0].update(right.cpu(), valid.cpu())
                    t[1] += sums.float().cpu()
                    t[2] += counts.float().cpu()
                    t[3] += 1
    finally:
        drafter.train(was_training)
    out = {}
    for name in sorted(tally, key=lambda x: (x == ALL, x)):  # the sets by name, then "all"
        counter, loss_sum, count, n = tally[name]
        summary = counter.summary(max_depth)
        summary["loss_per_step"] = (loss_sum / count.clamp(min=1)).tolist()
        summary["sequences"] = n
        summary["accept_len_at"] = {int(d): v for d, v in summary["est_accept_len"].items()}
        out[name] = summary
    return out


def predicted_for(per_set: dict, set_name: str, depth: int) -> float | None:
    """The estimated acceptance length of set_name at depth, None where there is none (also after a JSON
    round trip, whose keys are strings)."""
    at = (per_set.get(set_name) or {}).get("accept_len_at") or {}
    value = at.get(depth, at.get(str(depth)))
    return None if value is None else float(value)
