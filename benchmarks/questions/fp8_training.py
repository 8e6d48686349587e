"""Does training on fp8 shards cost acceptance: one run trained on its bf16 and on its fp8 shards.

Prints one JSON line per store dtype (shard bytes, tokens trained, estimated AL per depth).

Does training on fp8 shards cost acceptance? The same training on a run's bf16 shards and on the same shards
rewritten in fp8 (shards.convert_store_dtype: what an fp8 extraction writes, as both quantize the backend's
bf16), same params, seed and token budget; prints each one's validation AL per depth, bytes per token and
tokens/s, and fp8 / bf16.

    python -m benchmarks fp8_training outputs/tiny-s9 --params params/smollm2-135m-cpu.yaml --max-tokens 150000

RUN_DIR needs a finished 00_prepare and a bf16 01_extract; the two trainings write under
RUN_DIR-<tag>/<store dtype>/ (01_extract linked or converted, 02_train). train.max_minutes is lifted so
that the token budget, not the clock, ends both runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import eagle3lib  # noqa: F401  (OMP_WAIT_POLICY before torch)
from benchmarks import gpu_script
from eagle3lib.extract import shards
from eagle3lib.params import load_params
from eagle3lib.target import torch_dtype
from eagle3lib.train.runtime import launch


def prepare_run(src: Path, out: Path, store_dtype: str) -> dict:
    """out/<store_dtype>/: 00_prepare copied, 01_extract linked (bf16) or converted; its shards' figures."""
    run = out / store_dtype
    if (run / "00_prepare").exists():
        shutil.rmtree(run)
    shutil.copytree(src / "00_prepare", run / "00_prepare", ignore=shutil.ignore_patterns("*.ipynb", "*.html"))
    (run / "01_extract").mkdir(parents=True)
    shutil.copy(src / "01_extract" / "result.json", run / "01_extract" / "result.json")
    figures = {}
    for split in ("train", "val"):
        have = shards.ShardSet(src / "01_extract" / split)
        if have.manifest["store_dtype"] == store_dtype:
            os.symlink((src / "01_extract" / split).resolve(), run / "01_extract" / split)
            size = sum(e["bytes"] for e in have.shards)
            figures[split] = {"bytes_per_token": size / have.num_tokens}
        else:
            dtype = torch_dtype(store_dtype)
            figures[split] = shards.convert_store_dtype(have.out_dir, run / "01_extract" / split, dtype)
    return {"run_dir": run, "bytes_per_token": round(figures["train"]["bytes_per_token"], 1)}


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--params", default="params/smollm2-135m-cpu.yaml")
    ap.add_argument("--max-tokens", type=int, default=150_000)
    ap.add_argument("--set", action="append", default=[], help="more overrides, KEY=VALUE (YAML values)")
    ap.add_argument("--store-dtypes", nargs="+", default=["bfloat16", "float8_e4m3fn"])
    ap.add_argument("--tag", default="fp8-al", help="the runs go under RUN_DIR-TAG/")
    ap.add_argument("--stand-in", action="store_true", help="check the options, run nothing (dry run)")
    args = ap.parse_args(argv)
    if args.stand_in:
        return gpu_script.skip("the two trainings: they need a run folder with a finished bf16 01_extract")
    import yaml

    overrides = {"train.max_tokens": args.max_tokens, "train.max_minutes": 10_000}
    overrides |= {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    out = args.run_dir.parent / f"{args.run_dir.name}-{args.tag}"
    rows = {}
    for store_dtype in args.store_dtypes:
        run = prepare_run(args.run_dir, out, store_dtype)
        summary = launch.run_stage(load_params(args.params, overrides), str(run["run_dir"]))
        ev = summary["eval"]
        rows[store_dtype] = {
            "bytes_per_token": run["bytes_per_token"],
            "steps": summary["steps"],
            "tokens": summary["tokens"],
            "train_tokens_per_s": summary["train_tokens_per_s"],
            "cond_acc": [round(x, 4) for x in ev["cond_acc"]],
            "est_accept_len": ev["est_accept_len"],
            "loss_per_step": [round(x, 4) for x in ev["loss_per_step"]],
        }
        print(json.dumps({"store_dtype": store_dtype, **rows[store_dtype]}), flush=True)
    if set(rows) != {"bfloat16", "float8_e4m3fn"}:
        return
    bf16, fp8 = rows["bfloat16"], rows["float8_e4m3fn"]
    ratio = {d: round(fp8["est_accept_len"][d] / bf16["est_accept_len"][d], 4) for d in bf16["est_accept_len"]}
    print(
        json.dumps(
            {"fp8_over_bf16_AL": ratio, "bytes_per_token_ratio": fp8["bytes_per_token"] / bf16["bytes_per_token"]}
        )
    )
    (out / "result.json").write_text(
        json.dumps({"overrides": overrides, "runs": rows, "fp8_over_bf16_AL": ratio}, indent=1)
    )


def dry_run(work: Path) -> list[str]:
    return [str(work / "run"), "--stand-in"]


if __name__ == "__main__":
    sys.exit(main())
