"""Our extracted states in a peer trainer's own offline format, so that SpecForge and speculators train on exactly
the sequences, tokens, loss mask and hidden states that our trainer reads, with our train/validation split
(benchmarks/questions/peers.sh).

    python -m benchmarks.peer_data specforge   RUN_DIR/01_extract OUT_DIR
    python -m benchmarks.peer_data speculators RUN_DIR/01_extract OUT_DIR --target TARGET_DIR

The states are the same tensors, rewritten in bf16 (as both peers store them), never recaptured:
- specforge (0.2.0, `specforge train` with data.hidden_states_path / data.eval_hidden_states_path): OUT/train and
  OUT/val, each `rows_<a>-<b>/data_<i>.ckpt` (2,000 a folder, as its capture script groups them): a torch.save
  dict of input_ids [T] int64, loss_mask [T] int64, hidden_state [1, T, H] (the final norm's output, which our
  final_hidden is) and aux_hidden_state [1, T, 3H] (the aux states low to high: HF hidden_states ids
  [2, L/2, L-3], SpecForge's layer ids [1, L/2-1, L-4]).
- speculators (0.9.0, `speculators train --data-path OUT`): a `datasets` folder (columns input_ids, loss_mask,
  seq_len; train rows then validation rows, so that `--train-data-ratio` = the recorded train share keeps our split),
  `hidden_states/hs_<i>.safetensors` with hidden_states [T, 4, H] (the three aux states and the final state
  before the final norm) and token_ids [T], and `token_freq.pt` (loss-masked train tokens). speculators applies
  the target's final norm itself; ours stored its output y = x / rms(x) * w, so the file holds y / w, whose norm
  is y again (up to the norm's eps: a relative 1e-5).
OUT/source.json records the extraction folder, its contract and the counts, so that a result names its data.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import eagle3lib  # noqa: F401  (OMP_WAIT_POLICY before torch)
from eagle3lib import target
from eagle3lib.extract.shards import ShardSet

GROUP = 2000  # SpecForge's --file-group-size default


SPLITS = ("train", "val")


def sequences(shard_dir):
    """(input_ids int64, loss_mask int64, aux [T, 3H] float32, final [T, H] float32) of every sequence in order."""
    for ids, mask, aux, final in ShardSet(shard_dir):
        yield ids.long(), mask.long(), aux.float(), final.float()


def _empty_folder(out: Path) -> Path:
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty: remove it, or point OUT_DIR at a new folder")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _source(fmt: str, extract_dir: Path, counts: dict, **extra) -> dict:
    contract = ShardSet(extract_dir / "train").contract
    return {"format": fmt, "extraction": str(extract_dir.resolve()), "contract": contract, **counts, **extra}


def write_specforge(extract_dir, out) -> dict:
    """OUT/train and OUT/val in SpecForge's offline feature files."""
    extract_dir, out = Path(extract_dir), _empty_folder(Path(out))
    counts = {}
    for split in SPLITS:
        n = tokens = 0
        for i, (ids, mask, aux, final) in enumerate(sequences(extract_dir / split)):
            first = i // GROUP * GROUP
            path = out / split / f"rows_{first}-{first + GROUP}" / f"data_{i}.ckpt"
            path.parent.mkdir(parents=True, exist_ok=True)
            record = {
                "input_ids": ids,
                "loss_mask": mask,
                "hidden_state": final.to(torch.bfloat16).unsqueeze(0),
                "aux_hidden_state": aux.to(torch.bfloat16).unsqueeze(0),
            }
            torch.save(record, path)
            n, tokens = n + 1, tokens + ids.numel()
        counts[split] = {"sequences": n, "tokens": tokens}
    source = _source("specforge", extract_dir, counts)
    (out / "source.json").write_text(json.dumps(source, indent=2))
    return source


def write_speculators(extract_dir, out, norm_weight: torch.Tensor) -> dict:
    """One speculators data folder: train rows, then validation rows; train_data_ratio keeps the split."""
    from collections import Counter

    from datasets import Dataset
    from safetensors.torch import save_file

    extract_dir, out = Path(extract_dir), _empty_folder(Path(out))
    if bool((norm_weight == 0).any()):
        raise ValueError("the target's final norm has zero weights: its input cannot be recovered from its output")
    (out / "hidden_states").mkdir()
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    freq, counts, i = Counter(), {}, 0
    for split in SPLITS:
        n = tokens = 0
        for ids, mask, aux, final in sequences(extract_dir / split):
            states = torch.stack([*aux.chunk(3, dim=-1), final / norm_weight.float()], dim=1)
            tensors = {"hidden_states": states.to(torch.bfloat16).contiguous(), "token_ids": ids.contiguous()}
            save_file(tensors, str(out / "hidden_states" / f"hs_{i}.safetensors"))
            rows["input_ids"].append(ids.tolist())
            rows["loss_mask"].append(mask.tolist())
            rows["seq_len"].append(ids.numel())
            if split == "train":
                freq.update(ids[mask.bool()].tolist())
            i, n, tokens = i + 1, n + 1, tokens + ids.numel()
        counts[split] = {"sequences": n, "tokens": tokens}
    dataset = Dataset.from_dict(rows)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(out))
    torch.save(dict(freq), out / "token_freq.pt")
    ratio = counts["train"]["sequences"] / i
    source = _source("speculators", extract_dir, counts, train_data_ratio=ratio)
    (out / "source.json").write_text(json.dumps(source, indent=2))
    return source


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("format", choices=["specforge", "speculators"])
    ap.add_argument("extract_dir", type=Path, help="a run's 01_extract folder (train/ and val/ shard folders)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--target", help="speculators: the target folder (its final norm's weight)")
    a = ap.parse_args(argv)
    if a.format == "specforge":
        source = write_specforge(a.extract_dir, a.out)
    else:
        if not a.target:
            ap.error("speculators needs --target TARGET_DIR (the final norm's weight)")
        source = write_speculators(a.extract_dir, a.out, target.load_head_tensors(a.target)["norm"])
    print(json.dumps({k: v for k, v in source.items() if k != "contract"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
