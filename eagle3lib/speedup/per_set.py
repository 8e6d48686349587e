"""The sweep's figures regrouped the way papers report them: per prompt set (rows) and depth (column groups),
per category, and per context length, each with the training stage's prediction where there is one.

Per set figures come from each set's own measurement (configuration.measure); per category and per context length from
the statistics read around every request at concurrency 1 (measurement.measure_set), summed over the group.
"""

from __future__ import annotations

from eagle3lib.speedup import measurement, prompt_sets


def _depths(rows: list[dict]) -> list[int]:
    return sorted({r["depth"] for r in rows if r["depth"]})


def set_table(rows: list[dict], concurrency: int, predicted: dict | None = None) -> dict:
    """{concurrency, depths, sets: [{set, prompts, baseline_tokens_per_s, cells: {depth: {accept_len, speedup,
    predicted_accept_len}}}]} at one concurrency; predicted: bench.predict.predict_per_set's result."""
    at = [r for r in rows if r["concurrency"] == concurrency]
    base = next((r for r in at if not r["depth"]), None)
    if base is None:
        raise ValueError(f"no baseline row at concurrency {concurrency}")
    out = []
    for name, figures in base["sets"].items():
        cells = {}
        for r in at:
            f = r["sets"].get(name) if r["depth"] else None
            if f is not None:
                pred = ((predicted or {}).get(name) or {}).get("accept_len_at", {})
                cells[r["depth"]] = {
                    "accept_len": f.get("accept_len"),
                    "speedup": f.get("speedup"),
                    "requests": f["requests"],
                    "predicted_accept_len": pred.get(r["depth"], pred.get(str(r["depth"]))),
                }
        out.append(
            {"set": name, "prompts": figures["requests"], "baseline_tokens_per_s": figures["tokens_per_s"],
             "cells": cells}
        )  # fmt: skip
    return {"concurrency": concurrency, "depths": _depths(at), "sets": out}


def _grouped(rows: list[dict], key) -> list[dict]:
    """Acceptance per group of concurrency-1 requests (key: request figures -> group label or None), per depth."""
    groups: dict = {}
    for r in rows:
        if not r["depth"] or r["concurrency"] != 1 or not r.get("request_figures"):
            continue
        for req, part in zip(r["request_figures"], r["request_parts"]):
            label = key(req)
            if label is not None:
                g = groups.setdefault(label, {})
                g.setdefault(r["depth"], {"engine": r["engine"], "parts": [], "prompt_tokens": []})
                g[r["depth"]]["parts"].append(part)
                g[r["depth"]]["prompt_tokens"].append(req["prompt_tokens"])
    out = []
    for label, by_depth in groups.items():
        cells = {}
        for depth, g in sorted(by_depth.items()):
            spec = measurement.spec_over(g["engine"], g["parts"])
            cells[depth] = {
                "accept_len": spec.get("accept_len"),
                "requests": len(g["parts"]),
                "mean_prompt_tokens": sum(g["prompt_tokens"]) / len(g["prompt_tokens"]),
            }
        out.append({"group": label, "cells": cells})
    return out


def category_table(rows: list[dict]) -> list[dict]:
    """[{group: (set, category), cells: {depth: {accept_len, requests}}}] at concurrency 1."""
    return sorted(_grouped(rows, lambda q: (q["set"], q["category"] or "-")), key=lambda g: g["group"])


def context_table(rows: list[dict]) -> list[dict]:
    """[{group: bucket, cells: {depth: {accept_len, requests, mean_prompt_tokens}}}] at concurrency 1, every
    set's requests bucketed by prompt length (prompt_sets.CONTEXT_BUCKETS), shortest first."""
    order = [label for label, _ in prompt_sets.CONTEXT_BUCKETS]
    table = _grouped(rows, lambda q: prompt_sets.context_bucket(q["prompt_tokens"]))
    return sorted(table, key=lambda g: order.index(g["group"]))


def predicted_against_measured(table: dict) -> list[dict]:
    """Per set and depth: the training prediction against the engine's acceptance length, and whether it is
    within ±15% (the issue's bar)."""
    out = []
    for s in table["sets"]:
        for depth, c in sorted(s["cells"].items()):
            if c.get("predicted_accept_len") and c.get("accept_len"):
                ratio = c["predicted_accept_len"] / c["accept_len"]
                out.append(
                    {"set": s["set"], "depth": depth, "measured": c["accept_len"],
                     "predicted": c["predicted_accept_len"], "ratio": ratio, "within_15pct": abs(ratio - 1) <= 0.15}
                )  # fmt: skip
    return out
