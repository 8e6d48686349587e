"""Served AL against training tokens: our drafter and speculators' trained on the same prepared data at several sizes.

One regeneration of the embedded data (the target's own replies), each size the first sequences of its train split
within that many tokens (extract.max_train_tokens), every trainer 4 epochs and 3 seeds a size, served by SGLang at
depths 3 and 5. The GPU steps are peers' (benchmarks/questions/peers.sh) with SIZE=N, one size's folders apart
from another's; a host whose calls are time-limited runs one size's steps per stretch, brings the drafters back
and serves them in the next:

    MORE=1 REGEN_ONLY=1 REGEN_MIN=4 REGEN_BS=1024 REGEN_GRAPHS=1024 TO=prepare python -m benchmarks scaling gpu-plan data
    SIZE=600000 python -m benchmarks scaling gpu-plan data         # the cut, its extraction, the peers' formats
    SIZE=600000 JOBS="ours:defaults:0 ... speculators:sglang:2" python -m benchmarks scaling gpu-plan launch
    SIZE=600000 python -m benchmarks scaling gpu-plan wait
    SIZE=600000 SETS=held_out,mt_bench,humaneval,$D/gsm8k.jsonl,$D/sum.jsonl,$D/qa.jsonl,$D/alpaca.jsonl \
        python -m benchmarks scaling gpu-plan serve                 # summary.json: served_al's rows ($D: $WORK/data)

The prepared conversations of the first call, carried as $WORK/carried/prepared/, serve every size; a size's
drafters go out with BRING="..." `bring` and come back as $WORK/carried/drafters-$SIZE for `restore` and `serve`.
Then, on any machine, the figure from each size's served summaries:

    python -m benchmarks scaling --size 600000=summary-600k.json --size 2000000=summary-2m.json ... \\
        --ours ours:defaults --peer speculators:sglang

Prints one JSON row per size and depth (each trainer's AL over the sets with its 95% interval, the ratio with its
interval, and per set), and writes scaling.png (AL against training tokens, a line per trainer, a panel per depth)
and scaling.md beside --out's rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import al_interval, gpu_script

OUT_FILE = "scaling.json"
STEPS = ("data", "launch", "wait", "ours", "speculators", "offline", "serve", "bring", "restore")


def sized_summaries(items: list[str]) -> dict[int, list[Path]]:
    """['600000=a.json', '600000=b.json', '2000000=c.json'] -> {600000: [a, b], 2000000: [c]}."""
    out: dict[int, list[Path]] = {}
    for item in items:
        tokens, sep, path = item.partition("=")
        if not sep or not tokens.isdigit() or not path:
            raise SystemExit(f"--size {item!r}: expected TRAINING_TOKENS=SUMMARY_JSON (e.g. 600000=summary.json)")
        if not Path(path).is_file():
            raise SystemExit(f"--size {item!r}: {path} is not a file (served_al's summary.json of that size)")
        out.setdefault(int(tokens), []).append(Path(path))
    return out


def size_rows(tokens: int, rows: list[dict], ours: str, peer: str, resamples: int) -> list[dict]:
    """One row per depth served at this size: each trainer's AL (mean over the sets both served) with its interval,
    ours over the peer with its interval, and per set."""
    out = []
    for depth in sorted({r["depth"] for r in rows if r["set"] != "val"}):
        arrays = al_interval.served_arrays(rows, [ours, peer], depth)
        if not arrays:
            continue
        c = al_interval.compare(arrays, ours, peer, resamples)
        m = c["mean"]
        out.append(
            {
                "train_tokens": tokens,
                "depth": depth,
                "ours": ours,
                "peer": peer,
                "seeds": c["seeds"],
                "sets": c["prompts"],
                "al": m["al"],
                "al_interval": m["al_interval"],
                "ratio": m["ratio"],
                "low": m["low"],
                "high": m["high"],
                "per_set": {s: {k: v[k] for k in ("ratio", "low", "high")} for s, v in c["per_set"].items()},
            }
        )
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| training tokens | depth | seeds | ours AL [95%] | peer AL [95%] | ours / peer [95%] | per set: ratio |",
        "|---:|---:|---|---|---|---|---|",
    ]
    for r in rows:
        o, p = r["ours"], r["peer"]
        (ol, oh), (pl, ph) = r["al_interval"][o], r["al_interval"][p]
        per_set = "; ".join(f"{s} {v['ratio']:.3f}" for s, v in r["per_set"].items())
        lines.append(
            f"| {r['train_tokens']:,} | {r['depth']} | {r['seeds'][o]} / {r['seeds'][p]} | {r['al'][o]:.3f} "
            f"[{ol:.3f}, {oh:.3f}] | {r['al'][p]:.3f} [{pl:.3f}, {ph:.3f}] | **{r['ratio']:.3f}** "
            f"[{r['low']:.3f}, {r['high']:.3f}] | {per_set} |"
        )
    return "\n".join(lines)


def figure(rows: list[dict], path: Path) -> None:
    """Served AL against training tokens (log scale): a line per trainer with its interval, a panel per depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = sorted({r["depth"] for r in rows})
    fig, axes = plt.subplots(1, len(depths), figsize=(5 * len(depths), 3.8), squeeze=False)
    for ax, depth in zip(axes[0], depths, strict=True):
        at = sorted((r for r in rows if r["depth"] == depth), key=lambda r: r["train_tokens"])
        for key in ("ours", "peer"):
            name = at[0][key]
            x = [r["train_tokens"] for r in at]
            y = [r["al"][name] for r in at]
            err = [[r["al"][name] - r["al_interval"][name][0] for r in at],
                   [r["al_interval"][name][1] - r["al"][name] for r in at]]  # fmt: skip
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=name)
        ax.set_xscale("log")
        ax.set_xlabel("training tokens")
        ax.set_ylabel(f"served AL at depth {depth}")
        ax.set_title(f"depth {depth}: mean over sets, 95% interval")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def headline(rows: list[dict]) -> dict:
    """Ours over the peer at the largest size, per depth (with the interval's ends)."""
    rows = [r for r in rows if "train_tokens" in r]  # a GPU step's rows are the script's, not sizes
    if not rows:
        return {}
    largest = max(r["train_tokens"] for r in rows)
    out = {"largest_train_tokens": largest}
    for r in rows:
        if r["train_tokens"] == largest:
            out |= {f"ratio_d{r['depth']}": round(r["ratio"], 4), f"low_d{r['depth']}": round(r["low"], 4),
                    f"high_d{r['depth']}": round(r["high"], 4)}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu-plan"]:  # the GPU steps: peers' script, SIZE from the environment
        plan_args = list(argv[1:])
        if "--out" in plan_args:  # the runner's result file: the script's logs go into that folder's raw/
            i = plan_args.index("--out")
            out = Path(plan_args[i + 1])
            del plan_args[i : i + 2]
            if "--raw" not in plan_args:
                plan_args += ["--raw", str(out.parent / "raw")]
        return gpu_script.plan_main("peers", plan_args, {s: ([s], {}) for s in STEPS}, "serve")
    ap = argparse.ArgumentParser(prog="python -m benchmarks scaling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", action="append", required=True, help="TRAINING_TOKENS=SUMMARY_JSON, repeated")
    ap.add_argument("--ours", default="ours:defaults", help="TRAINER:CONFIG of our drafter in the summaries")
    ap.add_argument("--peer", default="speculators:sglang", help="TRAINER:CONFIG of the peer's")
    ap.add_argument("--resamples", type=int, default=al_interval.RESAMPLES)
    ap.add_argument("--out", type=Path, default=Path(OUT_FILE), help="the rows as JSON; the figure and table beside")
    a = ap.parse_args(argv)
    rows = []
    for tokens, files in sorted(sized_summaries(a.size).items()):
        served = [r for f in files for r in json.loads(f.read_text())["rows"]]
        found = size_rows(tokens, served, a.ours, a.peer, a.resamples)
        if not found:
            have = sorted({al_interval.config_name(r) for r in served})
            raise SystemExit(
                f"{', '.join(map(str, files))}: no prompts that both {a.ours} and {a.peer} served (these hold "
                f"{', '.join(have) or 'no served rows'}): name them with --ours / --peer"
            )
        rows += found
    for r in rows:
        print(json.dumps(r))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rows, indent=1) + "\n")
    figure(rows, a.out.with_suffix(".png"))
    a.out.with_suffix(".md").write_text(table(rows) + "\n")
    print(table(rows))
    return 0


def dry_run(work: Path) -> list[str]:
    """The figure from a served summary already in the results (one size: ~646 k tokens, 3 seeds a trainer)."""
    summary = Path(__file__).resolve().parents[1] / "results/peers/h100-2026-12-05/summary-d3.json"
    return ["--size", f"645974={summary}", "--ours", "ours:allpos", "--resamples", "500", "--out",
            str(work / OUT_FILE)]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
