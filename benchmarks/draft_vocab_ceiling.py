"""How much of a drafter's lost acceptance is its draft vocabulary: on the CPU, the target's own greedy replies to
benchmark prompts, each drafter's chain replayed on them (the engine's greedy acceptance, speedup/replay.py), and where
its first draft of a round missed, whether the target's token was in its draft vocabulary at all. With a prepared run
(`--counts-run`), the coverage of the target's replies by draft vocabularies of other sizes, chosen as training
chooses them (drafter/vocab.py over the run's train split).

    python -m benchmarks.draft_vocab_ceiling shipped=drafters/smollm2-135m-instruct remake=/tmp/remake/.../drafter \
        --counts-run /tmp/vocabrun/counts --per-set 20 --out /tmp/ceiling.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import eagle3lib  # noqa: F401  (OMP_WAIT_POLICY before torch)
from eagle3lib import target
from eagle3lib.drafter import vocab
from eagle3lib.prepare import conversations
from eagle3lib.speedup import prompt_sets, replay
from eagle3lib.train.runtime.checkpoint import load_drafter

SHARED = Path(__file__).resolve().parents[2] / "shared" / "benchsets"
SETS = ["mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa"]


def set_entry(name: str) -> str:
    """A set's entry for prompt_sets: the packaged ones by name, EAGLE's others from ../shared/benchsets."""
    if name in ("mt_bench", "humaneval"):
        return name
    path = SHARED / name / "question.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} missing: EAGLE's question sets are read from ../shared/benchsets")
    return str(path)


def greedy_replies(model, render, per_set: int, max_tokens: int, cache_file: Path) -> list[dict]:
    """First-turn prompts of each set and the target's greedy replies, kept in cache_file between runs."""
    if cache_file.is_file():
        return json.loads(cache_file.read_text())
    prompts = [
        q for q in prompt_sets.build_prompts(render, [set_entry(s) for s in SETS], per_set, []) if q["turn"] == 1
    ]
    t0, out = time.perf_counter(), []
    for i, q in enumerate(prompts):
        out.append({"id": q["id"], "set": q["set"], "prompt_ids": q["prompt_ids"],
                    "token_ids": replay.greedy_decode(model, q["prompt_ids"], max_tokens)})  # fmt: skip
        print(f"greedy {i + 1}/{len(prompts)} {time.perf_counter() - t0:.0f} s", flush=True)
    cache_file.write_text(json.dumps(out))
    return out


def replayed(model, drafter, seqs: list[dict], depth: int) -> dict:
    """Per set: the chain's acceptance length, and the rounds whose first draft missed split by whether the
    target's token was in the draft vocabulary."""
    in_vocab = drafter.t2d.bool()
    per_set = {}
    for s in seqs:
        r = replay.speculative_decode(model, drafter, s["prompt_ids"], depth, len(s["token_ids"]))
        if r["token_ids"] != s["token_ids"]:  # the replay is lossless against the same greedy decode
            print(f"{s['id']}: the replay's tokens differ from the greedy reply (fp32 ties)", flush=True)
        # a round starts after each target-made token; its first draft missed where the next token is the target's
        tokens, source = r["token_ids"], r["source"]
        first_miss = [tokens[k + 1] for k in range(len(tokens) - 1) if source[k] == replay.TARGET
                      and source[k + 1] == replay.TARGET]  # fmt: skip
        t = per_set.setdefault(s["set"], {"rounds": 0, "accepted": 0, "first_miss": 0, "first_miss_oov": 0,
                                           "reply_tokens": 0, "reply_oov": 0})  # fmt: skip
        t["rounds"] += r["rounds"]
        t["accepted"] += r["accepted"]
        t["first_miss"] += len(first_miss)
        t["first_miss_oov"] += sum(not bool(in_vocab[x]) for x in first_miss)
        t["reply_tokens"] += len(s["token_ids"])
        t["reply_oov"] += sum(not bool(in_vocab[x]) for x in s["token_ids"])
    for t in per_set.values():
        t["accept_len"] = round(1 + t["accepted"] / t["rounds"], 4)
        t["reply_coverage"] = round(1 - t["reply_oov"] / t["reply_tokens"], 4)
        t["first_miss_oov_share"] = round(t["first_miss_oov"] / max(1, t["first_miss"]), 4)
    return per_set


def coverage_by_size(counts_run: Path, seqs: list[dict], sizes: list[int], vocab_size: int) -> dict:
    """{size: {set: coverage of the target's reply tokens}} for draft vocabularies chosen from counts_run's train
    split as training chooses them (assistant tokens, then the rest)."""
    tokens = conversations.load_tokens(counts_run / "00_prepare" / "train.safetensors")
    counts = vocab.token_counts(tokens["input_ids"], tokens["loss_mask"], vocab_size)
    all_counts = vocab.token_counts(tokens["input_ids"], torch.ones_like(tokens["loss_mask"]), vocab_size)
    out = {}
    for size in sizes:
        _, t2d = vocab.build_draft_vocab(counts, size, fallback_counts=all_counts)
        cov = {}
        for s in seqs:
            c = cov.setdefault(s["set"], [0, 0])
            c[0] += sum(bool(t2d[x]) for x in s["token_ids"])
            c[1] += len(s["token_ids"])
        out[size] = {name: round(a / b, 4) for name, (a, b) in cov.items()}
        out[size]["mean"] = round(sum(out[size].values()) / len(cov), 4)
    return {"train_tokens": int(tokens["input_ids"].numel()), "coverage": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafters", nargs="*", help="NAME=FOLDER, canonical drafter checkpoints")
    ap.add_argument("--per-set", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--counts-run", type=Path, help="a run with 00_prepare: coverage of other vocabulary sizes")
    ap.add_argument("--sizes", default="2048,4096,8192,16384,32768")
    ap.add_argument("--replies", type=Path, default=Path("/tmp/draft_vocab_ceiling_replies.json"))
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    tdir = target.embedded_target_dir(target.default_cache_dir())
    model, tokenizer = target.load_target(str(tdir), target.default_cache_dir(), dtype="float32", device="cpu")
    seqs = greedy_replies(model, prompt_sets.renderer(tokenizer), a.per_set, a.max_tokens, a.replies)
    result = {"what": __doc__.split("\n\n")[0], "depth": a.depth, "prompts": len(seqs), "max_tokens": a.max_tokens,
              "target_dtype": "float32", "drafters": {}}  # fmt: skip
    for spec in a.drafters:
        name, folder = spec.split("=", 1)
        drafter = load_drafter(Path(folder)).float().eval()
        t0 = time.perf_counter()
        per_set = replayed(model, drafter, seqs, a.depth)
        mean = {k: round(sum(t[k] for t in per_set.values()) / len(per_set), 4)
                for k in ("accept_len", "reply_coverage", "first_miss_oov_share")}  # fmt: skip
        result["drafters"][name] = {"folder": folder, "draft_vocab_size": drafter.cfg.draft_vocab_size,
                                    "per_set": per_set, "mean": mean}  # fmt: skip
        print(name, json.dumps(mean), f"{time.perf_counter() - t0:.0f} s", flush=True)
    if a.counts_run:
        result["vocab_sizes"] = coverage_by_size(
            a.counts_run, seqs, [int(x) for x in a.sizes.split(",")], model.config.vocab_size
        )
        print(json.dumps(result["vocab_sizes"]["coverage"]), flush=True)
    a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
