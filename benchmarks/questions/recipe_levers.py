"""Acceptance per CPU-minute of training recipe levers: 02_train once per lever on one run's data and budget.

Prints one JSON line per lever (tokens trained, estimated AL per depth).

Acceptance per CPU-minute: 02_train on one run's data and budget, once per lever, side by side.

Each lever is a set of params overrides; every lever trains from scratch on the same run folder's shards
(00_prepare and 01_extract must have finished) with the same time budget, into a scratch folder, and prints the
tokens it trained on and the validation's estimated acceptance length per depth (docs/design.md §5).

    python -m benchmarks recipe_levers --run-dir outputs/tiny --minutes 4 \
        --lever default \
        --lever 'ttt3:train.ttt_steps=3' \
        --lever 'lr2e-3:train.lr=2e-3' \
        --lever 'norms:train.eagle31_norms=[norm_before_fc,norm_output]'

Figures go to stdout and, one JSON line per lever, to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_script  # noqa: E402
from eagle3lib.params import load_params, parse_override  # noqa: E402
from eagle3lib.train import loop  # noqa: E402
from eagle3lib.train.runtime.setup import build_setup  # noqa: E402


def parse_lever(text: str) -> tuple[str, dict]:
    """'name:key=value,key=value' (each as a command-line override; a value may be a [list, of, items]) ->
    (name, overrides); 'name' alone = none."""
    name, _, rest = text.partition(":")
    parts, depth, current = [], 0, ""
    for ch in rest:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return name, dict(parse_override(part) for part in filter(None, [*parts, current]))


def run_lever(
    params_file: str, run_dir: Path, minutes: float, name: str, overrides: dict, seed: int, tokens: int | None = None
) -> dict:
    budget = (
        {"train.max_minutes": minutes} if tokens is None else {"train.max_tokens": tokens, "train.max_minutes": 600}
    )
    p = load_params(params_file, {**overrides, **budget, "train.resume": False})
    setup, vocab_stats = build_setup(p, run_dir)
    with tempfile.TemporaryDirectory() as scratch:
        setup.out_dir = Path(scratch)
        t0 = time.time()
        summary = loop.train(setup, p.train, seed=seed, log=lambda *_: None)
    ev = summary["eval"]
    return {
        "lever": name,
        "overrides": overrides,
        "minutes": minutes,
        "tokens": summary["tokens"],
        "steps": [summary["steps"], summary["total_steps"]],  # taken, and the schedule's length
        "train_tokens_per_s": summary["train_tokens_per_s"],
        "wall_s": round(time.time() - t0, 1),
        "val_coverage": vocab_stats["val_coverage"],
        "cond_acc": [round(x, 4) for x in ev["cond_acc"]],
        "est_accept_len": {d: ev["est_accept_len"][d] for d in ("1", "2", "3", "5")},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default=str(ROOT / "params" / "smollm2-135m-cpu.yaml"))
    ap.add_argument("--run-dir", required=True, help="a run folder whose 00_prepare and 01_extract finished")
    ap.add_argument("--minutes", type=float, default=4.0, help="training budget per lever")
    ap.add_argument("--tokens", type=int, default=None, help="a token budget per lever instead of the minutes")
    ap.add_argument("--lever", action="append", required=True, help="name:key=value,... (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="append one JSON line per lever here")
    ap.add_argument("--stand-in", action="store_true", help="check the options, run nothing (dry run)")
    a = ap.parse_args(argv)
    if a.stand_in:
        return gpu_script.skip("the trainings: they need a run folder whose 00_prepare and 01_extract finished")
    print(f"{'lever':<24} {'tokens':>8} {'tok/s':>6} {'AL@1':>5} {'AL@2':>5} {'AL@3':>5} {'AL@5':>5}  cond_acc")
    for text in a.lever:
        name, overrides = parse_lever(text)
        r = run_lever(a.params, Path(a.run_dir), a.minutes, name, overrides, a.seed, a.tokens)
        al = r["est_accept_len"]
        print(
            f"{name:<24} {r['tokens']:>8} {r['train_tokens_per_s']:>6.0f} {al['1']:>5.2f} {al['2']:>5.2f} "
            f"{al['3']:>5.2f} {al['5']:>5.2f}  {' '.join(f'{c:.2f}' for c in r['cond_acc'])}",
            flush=True,
        )
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(r) + "\n")


OUT_FILE = "levers.jsonl"


def dry_run(work: Path) -> list[str]:
    return ["--run-dir", str(work / "run"), "--lever", "default", "--lever", "ttt3:train.ttt_steps=3", "--stand-in"]


if __name__ == "__main__":
    sys.exit(main())
