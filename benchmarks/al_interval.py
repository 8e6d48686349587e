"""The ratio of two drafter configurations' served acceptance length, with a 95% interval that a few percent can be
read from: several seeds per configuration, the same prompts served to every drafter.

    python -m benchmarks.al_interval summary.json [more.json ...] --base speculators:sglang [--resamples 10000]

summary.json is served_al's (several: their rows together, e.g. one call's depth 3 and another's depth 5): rows of (trainer, config, seed, depth, set) with per_prompt [[id, tokens, accept
length], ...]. A configuration's AL on a set is the mean over its seeds of Σ tokens / Σ verify steps over the
set's prompts (steps = tokens / accept length, what the engine counted); over the sets, the mean of the sets (each
set weighs the same, whatever its prompt count). The interval is a two-level bootstrap: each resample draws every
set's prompts with replacement, the same draw for every drafter (the drafters served the same prompts greedily,
so they are paired by prompt), and each configuration's seeds with replacement; the 2.5th and 97.5th percentiles
of the resampled ratios. Prompts that some drafter did not serve are left out of that comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

RESAMPLES = 10_000


def config_name(row: dict) -> str:
    return f"{row['trainer']}:{row['config']}"


def served_arrays(rows: list[dict], configs: list[str], depth: int) -> dict:
    """{set: {config: (tokens [seeds, prompts], steps [seeds, prompts])}} over the prompts every drafter of these
    configurations served at this depth, in one order; sets some configuration lacks are left out."""
    by = {}
    for r in rows:
        if r["set"] == "val" or r["depth"] != depth or not r.get("per_prompt") or config_name(r) not in configs:
            continue
        by.setdefault(r["set"], {}).setdefault(config_name(r), {})[r.get("seed")] = {
            pid: (tokens, tokens / al) for pid, tokens, al in r["per_prompt"] if tokens and al
        }
    out = {}
    for set_name, per_config in by.items():
        if set(per_config) != set(configs):
            continue
        ids = sorted(set.intersection(*(set(p) for seeds in per_config.values() for p in seeds.values())), key=str)
        if not ids:
            continue
        out[set_name] = {
            c: (
                np.array([[seeds[s][i][0] for i in ids] for s in sorted(seeds, key=str)], dtype=float),
                np.array([[seeds[s][i][1] for i in ids] for s in sorted(seeds, key=str)], dtype=float),
            )
            for c, seeds in per_config.items()
        }
    return out


def _al(tokens: np.ndarray, steps: np.ndarray, prompts: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """[resamples]: the mean over resampled seeds of Σ tokens / Σ steps over resampled prompts."""
    # tokens[seeds][:, prompts] for each resample: [R, S, P] -> sums over prompts [R, S]
    t = tokens[:, prompts].sum(-1).T  # [R, S_all]
    s = steps[:, prompts].sum(-1).T
    per_seed = t / s  # [R, S_all]
    return np.take_along_axis(per_seed, seeds, axis=1).mean(1)


def compare(arrays: dict, a: str, b: str, resamples: int = RESAMPLES, rng_seed: int = 0) -> dict:
    """a's AL over b's, per set and mean over sets: the point estimate and the two-level bootstrap's 95% interval."""
    rng = np.random.default_rng(rng_seed)
    point = {c: {} for c in (a, b)}
    boot = {c: {} for c in (a, b)}
    for set_name, per_config in arrays.items():
        n = per_config[a][0].shape[1]
        prompts = rng.integers(0, n, size=(resamples, n))
        for c in (a, b):
            tokens, steps = per_config[c]
            seeds = rng.integers(0, tokens.shape[0], size=(resamples, tokens.shape[0]))
            point[c][set_name] = float((tokens.sum(1) / steps.sum(1)).mean())
            boot[c][set_name] = _al(tokens, steps, prompts, seeds)

    def summary(ratio_point: float, ratio_boot: np.ndarray) -> dict:
        low, high = np.percentile(ratio_boot, [2.5, 97.5])
        return {"ratio": ratio_point, "low": float(low), "high": float(high)}

    sets = sorted(arrays)
    out = {
        "a": a,
        "b": b,
        "seeds": {c: int(arrays[sets[0]][c][0].shape[0]) for c in (a, b)} if sets else {},
        "prompts": {s: int(arrays[s][a][0].shape[1]) for s in sets},
        "per_set": {},
    }
    for s in sets:
        out["per_set"][s] = {"al": {c: point[c][s] for c in (a, b)},
                             **summary(point[a][s] / point[b][s], boot[a][s] / boot[b][s])}  # fmt: skip
    if sets:
        mean_point = {c: float(np.mean([point[c][s] for s in sets])) for c in (a, b)}
        mean_boot = {c: np.mean([boot[c][s] for s in sets], axis=0) for c in (a, b)}
        out["mean"] = {"al": mean_point, **summary(mean_point[a] / mean_point[b], mean_boot[a] / mean_boot[b])}
        # each configuration's own AL interval (the same resamples): what a figure of AL against data draws
        out["mean"]["al_interval"] = {c: [float(v) for v in np.percentile(mean_boot[c], [2.5, 97.5])] for c in (a, b)}
    return out


def ratios(rows: list[dict], base: str, resamples: int = RESAMPLES) -> list[dict]:
    """Every other configuration against base, at every depth served: compare()'s figures plus the depth."""
    configs = sorted({config_name(r) for r in rows if r["set"] != "val" and r.get("per_prompt")})
    depths = sorted({r["depth"] for r in rows if r["set"] != "val"})
    out = []
    for depth in depths:
        for other in configs:
            if other == base or base not in configs:
                continue
            arrays = served_arrays(rows, [other, base], depth)
            if arrays:
                out.append({"depth": depth, **compare(arrays, other, base, resamples)})
    return out


def table(comparisons: list[dict]) -> str:
    """Markdown: one line per comparison and depth, the mean over sets first, then each set."""
    lines = ["| a / b | depth | seeds | mean over sets: AL a, AL b, ratio [95%] | per set: ratio [95%] |",
             "|---|---:|---|---|---|"]  # fmt: skip
    for c in comparisons:
        if "mean" not in c:
            continue
        m = c["mean"]
        per_set = "; ".join(
            f"{s} ({c['prompts'][s]}) {v['ratio']:.3f} [{v['low']:.3f}, {v['high']:.3f}]"
            for s, v in c["per_set"].items()
        )
        lines.append(
            f"| {c['a']} / {c['b']} | {c['depth']} | {c['seeds'][c['a']]} / {c['seeds'][c['b']]} | "
            f"{m['al'][c['a']]:.3f}, {m['al'][c['b']]:.3f}, **{m['ratio']:.3f}** [{m['low']:.3f}, {m['high']:.3f}] "
            f"| {per_set} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("summary", type=Path, nargs="+", help="served_al's summary.json files")
    ap.add_argument("--base", required=True, help="TRAINER:CONFIG the others are divided by")
    ap.add_argument("--resamples", type=int, default=RESAMPLES)
    ap.add_argument("--out", type=Path, default=None, help="the comparisons as JSON")
    a = ap.parse_args(argv)
    rows = [r for f in a.summary for r in json.loads(f.read_text())["rows"]]
    comparisons = ratios(rows, a.base, a.resamples)
    if not comparisons:
        raise SystemExit(
            f"{' '.join(map(str, a.summary))}: no served rows with per_prompt figures for {a.base} and another configuration"
        )
    print(table(comparisons))
    if a.out:
        a.out.write_text(json.dumps(comparisons, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
