"""The hf backend of 01_extract (the default and the reference): the Hugging Face model in this process,
one forward per batch of padded sequences, hooks on the aux layers.

    extract(model, tokens, aux_layer_ids, out_dir, contract)   # = shards.extract_with(HFCapture(...), ...)
"""

from __future__ import annotations

import time

import torch

from eagle3lib.extract.shards import CaptureHere, ShardLayout, as_token_tensors, extract_with, plan_batches, plan_shards


def base_model(model):
    """model.model, the decoder stack of a Llama-like causal LM (what the hooks and the plain forward run)."""
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "norm"):
        raise TypeError(
            f"expected a Hugging Face causal LM with model.model.layers and model.model.norm "
            f"(Llama-like), found {type(model).__name__}; load the target with target.py"
        )
    return base


@torch.inference_mode()
def capture_hidden_states(model, input_ids, attention_mask, aux_layer_ids):
    """One forward of the target's base model, keeping only what EAGLE-3 needs.

    Ids use Hugging Face `hidden_states` indexing: id i is the residual stream after
    i decoder layers (0 = embeddings), i.e. the input of decoder layer i; it is taken
    with a pre-hook on layers[i], so no other layer's states are kept. Returns
    aux [B, T, len(ids)*H] (concatenated in id order) and final [B, T, H], the final
    norm's output, so that model.lm_head(final) are the target's logits. The lm_head
    itself is not computed.
    """
    base = base_model(model)
    n_layers = len(base.layers)
    for i in aux_layer_ids:
        if not 0 <= int(i) < n_layers:
            raise ValueError(
                f"aux layer id {i} out of range: expected 0 <= id < {n_layers} (the target's "
                f"decoder layers, HF hidden_states indexing; id {n_layers} is the final norm "
                f"output, which is stored as final_hidden anyway); fix aux_layer_ids"
            )
    captured = {}

    def keep(k):
        def hook(module, args, kwargs):
            captured[k] = args[0] if args else kwargs["hidden_states"]

        return hook

    handles = [
        base.layers[int(i)].register_forward_pre_hook(keep(k), with_kwargs=True) for k, i in enumerate(aux_layer_ids)
    ]
    device = base.embed_tokens.weight.device
    try:
        out = base(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    final = out.last_hidden_state
    aux = torch.cat([captured[k].to(final.device) for k in range(len(aux_layer_ids))], dim=-1)
    return aux, final


def capture_sequences(model, sequences: list, aux_layer_ids) -> list[tuple]:
    """(aux [n, k*H], final [n, H]) on the CPU for each of these id tensors, from one forward of them right-padded
    together (online training's capture; a sequence alone is one unpadded forward, as extraction runs it)."""
    longest = max(len(ids) for ids in sequences)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    mask = torch.zeros(len(sequences), longest, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    aux, final = capture_hidden_states(model, ids, mask, aux_layer_ids)
    return [(aux[row, : len(seq)].cpu(), final[row, : len(seq)].cpu()) for row, seq in enumerate(sequences)]


def make_batch(tok, seq_ids):
    """Right-padded input_ids [B, T] (pad id 0) and attention_mask [B, T] for these sequences."""
    spans = [(int(tok["seq_starts"][s]), int(tok["seq_starts"][s + 1])) for s in seq_ids]
    T = max(b - a for a, b in spans)
    ids = torch.zeros(len(seq_ids), T, dtype=torch.long)
    mask = torch.zeros(len(seq_ids), T, dtype=torch.long)
    for row, (a, b) in enumerate(spans):
        ids[row, : b - a] = tok["input_ids"][a:b]
        mask[row, : b - a] = 1
    return ids, mask


def _range_batches(tok, lengths, first, end, batch_tokens):
    for seq_ids in plan_batches(lengths, range(first, end), batch_tokens):
        yield (seq_ids, *make_batch(tok, seq_ids))


def iter_batches(tokens, batch_tokens, shard_max_tokens):
    """The (seq_ids, input_ids, attention_mask) batches a full extraction runs, in its order."""
    tok = as_token_tensors(tokens)
    lengths = (tok["seq_starts"][1:] - tok["seq_starts"][:-1]).tolist()
    for first, end in plan_shards(lengths, 0, len(lengths), shard_max_tokens):
        yield from _range_batches(tok, lengths, first, end, batch_tokens)


@torch.inference_mode()
def measure_forward_tokens_per_s(model, batches, warmup=1):
    """Real tokens/s of the target's plain forward (model.model, no hooks, no writes) on these
    (seq_ids, input_ids, attention_mask) batches; the first `warmup` batches are run untimed."""
    base = base_model(model)
    batches = list(batches)
    device = base.embed_tokens.weight.device
    for _, ids, mask in batches[:warmup]:
        base(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
    timed = batches[warmup:] or batches
    _sync(device)
    t0, tokens = time.perf_counter(), 0
    for _, ids, mask in timed:
        base(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
        tokens += int(mask.sum())
    _sync(device)
    return tokens / (time.perf_counter() - t0)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _extract_shard(model, tok, lengths, first, end, aux_layer_ids, batch_tokens, store_dtype, hidden_size, bar):
    """The hf backend's states for sequences [first, end): aux [n, k*H] and final [n, H] in store_dtype."""
    starts = tok["seq_starts"]
    base, n = int(starts[first]), int(starts[end] - starts[first])
    aux_buf = torch.empty(n, len(aux_layer_ids) * hidden_size, dtype=store_dtype)
    final_buf = torch.empty(n, hidden_size, dtype=store_dtype)
    for seq_ids, ids, mask in _range_batches(tok, lengths, first, end, batch_tokens):
        aux, final = capture_hidden_states(model, ids, mask, aux_layer_ids)
        aux, final = aux.to(store_dtype).cpu(), final.to(store_dtype).cpu()
        for b, s in enumerate(seq_ids):
            a, m = int(starts[s]) - base, lengths[s]
            aux_buf[a : a + m] = aux[b, :m]
            final_buf[a : a + m] = final[b, :m]
        bar.update(int(mask.sum()))
    return aux_buf, final_buf


class HFCapture(CaptureHere):
    """The hf backend as a shards.Capture: one forward of the Hugging Face model per batch, hooks on
    the aux layers (capture_hidden_states)."""

    name = "hf"

    def __init__(self, model, aux_layer_ids, batch_tokens=4096):
        self.model, self.aux_layer_ids, self.batch_tokens = model, [int(i) for i in aux_layer_ids], batch_tokens
        self.vocab_size, self.hidden_size = base_model(model).embed_tokens.weight.shape

    def shard(self, tok, lengths, first, end, store_dtype, bar):
        return _extract_shard(
            self.model,
            tok,
            lengths,
            first,
            end,
            self.aux_layer_ids,
            self.batch_tokens,
            store_dtype,
            self.hidden_size,
            bar,
        )


def extract(
    model,
    tokens,
    aux_layer_ids,
    out_dir,
    contract,
    batch_tokens=4096,
    shard_max_tokens=None,
    store_dtype=torch.bfloat16,
    **options,
):
    """Capture aux + final hidden states for every sequence with the Hugging Face model (the hf
    backend) and write them as shards in out_dir, laid out as ShardLayout(store_dtype, shard_max_tokens,
    batch_tokens) (batch_tokens is the forward's budget too); options and result as shards.extract_with's."""
    capture = HFCapture(model, aux_layer_ids, batch_tokens)
    layout = ShardLayout(store_dtype, shard_max_tokens, batch_tokens)
    return extract_with(capture, tokens, aux_layer_ids, out_dir, contract, layout, **options)
