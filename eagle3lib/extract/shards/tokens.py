"""The prepare stage's token arrays as the writer takes them: `input_ids` int32 [N], `loss_mask` uint8 [N],
`seq_starts` int64 [S+1] (sequence s is input_ids[seq_starts[s]:seq_starts[s+1]])."""

from __future__ import annotations

import hashlib

import torch


def as_token_tensors(tokens):
    """Check the prepare stage's arrays (numpy or torch) and return them as torch tensors."""
    missing = [k for k in ("input_ids", "loss_mask", "seq_starts") if k not in tokens]
    if missing:
        raise KeyError(f"tokens: expected keys input_ids, loss_mask, seq_starts; missing {missing}")
    ids = torch.as_tensor(tokens["input_ids"]).to(torch.int32).reshape(-1)
    mask = torch.as_tensor(tokens["loss_mask"]).to(torch.uint8).reshape(-1)
    starts = torch.as_tensor(tokens["seq_starts"]).to(torch.int64).reshape(-1)
    n = ids.numel()
    if mask.numel() != n:
        raise ValueError(f"tokens: loss_mask has {mask.numel()} entries, input_ids {n}; expected equal")
    if starts.numel() < 1 or starts[0] != 0 or starts[-1] != n:
        raise ValueError(
            f"tokens: expected seq_starts to run from 0 to len(input_ids)={n}, found "
            f"{starts[:1].tolist()}..{starts[-1:].tolist()}; rerun the prepare stage"
        )
    lengths = starts[1:] - starts[:-1]
    if (lengths <= 0).any():
        s = int(torch.nonzero(lengths <= 0)[0])
        raise ValueError(
            f"tokens: sequence {s} has length {int(lengths[s])}; expected every sequence to have "
            f"at least one token; drop empty sequences in the prepare stage"
        )
    return {"input_ids": ids, "loss_mask": mask, "seq_starts": starts}


def input_sha256(tok):
    h = hashlib.sha256()
    for k, dtype in (("input_ids", torch.int32), ("loss_mask", torch.uint8), ("seq_starts", torch.int64)):
        h.update(tok[k].to(dtype).contiguous().numpy())
    return h.hexdigest()
