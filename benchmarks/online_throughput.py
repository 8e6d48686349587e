"""Online training against shards on one host (issue 33): trainer tokens/s offline (from 01_extract's shards),
online with the capture in a thread, online with a capture process and a trainer over gloo, with --ray online with
a capture actor and a trainer actor on a local Ray cluster, and in the same run the two parts alone, for the
take-turns bound 1 / (1/capture + 1/train).

    python -m eagle3lib run params/ci.yaml --to extract --set run.output_root=/tmp/bench-online
    python benchmarks/online_throughput.py --run-dir /tmp/bench-online/ci --params params/ci.yaml --tokens 8000

Every mode trains from scratch with the same params and token budget into its own copy of the run folder (the
shards run reads the run's 01_extract). capture alone: online mode's capture (train/online.py, extract.batch_tokens
per forward) over the training split's first epoch in order, nothing trained. One JSON line per mode goes to --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3lib.params import load_params  # noqa: E402
from eagle3lib.prepare import conversations  # noqa: E402
from eagle3lib.train import online, placement, trainer  # noqa: E402


def scratch_run(run_dir: Path, into: Path, with_shards: bool) -> Path:
    """A copy of the run folder's 00_prepare (and 01_extract for the shards mode) in `into`."""
    out = into / run_dir.name
    shutil.copytree(run_dir / "00_prepare", out / "00_prepare")
    if with_shards:
        (out / "01_extract").symlink_to(run_dir / "01_extract")
    return out


def capture_alone(params_file: str, overrides: dict, run_dir: Path, tokens: int) -> dict:
    p = load_params(params_file, overrides | {"train.source": "online"})
    train_tokens = conversations.load_tokens(run_dir / "00_prepare" / "train.safetensors")
    data, _, _ = online.capture_setup(p, train_tokens, train_tokens, run_dir / "02_train")
    started, done = time.perf_counter(), 0
    for seq in data.train_sequences(0, 0):
        done += len(seq.input_ids)
        if done >= tokens:
            break
    return {"mode": "capture alone", "tokens": done, "tokens_per_s": round(done / (time.perf_counter() - started), 1)}


def train_mode(name: str, params_file: str, overrides: dict, run_dir: Path, scratch: Path) -> dict:
    source = overrides.get("train.source", "shards")
    run = scratch_run(run_dir, scratch / name.replace(" ", "_"), with_shards=source == "shards")
    started = time.perf_counter()
    s = trainer.launch(params_file, str(run), overrides, 1)
    wall = time.perf_counter() - started
    row = {"mode": name, "tokens": s["tokens"], "tokens_per_s": s["train_tokens_per_s"], "wall_s": round(wall, 1)}
    row |= {"data_wait_s": s["data_wait_s"], "est_accept_len@3": s["eval"]["est_accept_len"].get("3")}
    capture = run / "02_train" / placement.CAPTURE_SUMMARY
    if capture.is_file():
        row["capture_process"] = json.loads(capture.read_text())
    elif s.get("online"):
        row["capture_thread"] = s["online"]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True, help="a run folder whose 00_prepare and 01_extract finished")
    ap.add_argument("--params", required=True, help="that run's params file")
    ap.add_argument("--tokens", type=int, default=8000, help="train.max_tokens of each mode")
    ap.add_argument("--out", default=None, help="JSONL file for the rows (appended)")
    ap.add_argument(
        "--no-process", action="store_true", help="leave out the capture-process mode (one GPU: its two ranks need two)"
    )
    ap.add_argument(
        "--ray",
        action="store_true",
        help="add the Ray mode (train.online_placement: ray, a local cluster); Ray from this environment or .ray-site",
    )
    args = ap.parse_args()
    run_dir = Path(args.run_dir)
    common = {
        "train.max_tokens": args.tokens,
        "train.resume": False,
        "train.eval_every": 10**6,  # one evaluation at the end: the rate is the step's and the capture's
        "train.checkpoint_every": 10**6,
    }
    modes = [
        ("offline (shards)", {}),
        ("online thread", {"train.source": "online"}),
        ("online gloo processes", {"train.source": "online", "train.online_placement": "process"}),
    ][: 2 if args.no_process else 3]
    if args.ray:
        ray_site = ROOT / ".ray-site"  # where the tests read Ray from, outside the workbook's environment
        if ray_site.is_dir() and str(ray_site) not in sys.path:
            sys.path.append(str(ray_site))
        modes.append(("online ray actors", {"train.source": "online", "train.online_placement": "ray"}))
    rows = []
    with tempfile.TemporaryDirectory(prefix="online-bench-") as scratch:
        rows.append(capture_alone(args.params, common, run_dir, args.tokens))
        print(json.dumps(rows[-1]), flush=True)
        for name, overrides in modes:
            rows.append(train_mode(name, args.params, common | overrides, run_dir, Path(scratch)))
            print(json.dumps(rows[-1]), flush=True)
    by = {r["mode"]: r["tokens_per_s"] for r in rows}
    capture, train = by["capture alone"], by["offline (shards)"]
    bound = 1 / (1 / capture + 1 / train)
    summary = {"mode": "take-turns bound", "tokens_per_s": round(bound, 1), "capture": capture, "train": train}
    rows.append(summary)
    print(f"\n{'mode':<24} {'tokens/s':>9} {'of bound':>9}")
    for r in rows:
        print(f"{r['mode']:<24} {r['tokens_per_s']:>9,.1f} {r['tokens_per_s'] / bound:>9.2f}")
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
