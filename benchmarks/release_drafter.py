"""The released drafter's folder (drafters/<name>/) from what benchmarks/questions/release.sh brought back: the canonical
checkpoint stored in bf16, the ids of the conversations it saw, and provenance.json (params, commit, data hashes,
tokens trained, GPU time, offline and served acceptance, each file's sha256), which tests/e2e/test_released_drafter.py
checks the shipped files against.

    python -m benchmarks.release_drafter UNPACKED --sharegpt DATA_DIR/sharegpt-7000.json.xz \
        [DATA_DIR/sharegpt-rest.json.xz] --out drafters/smollm2-135m-instruct

(the second file where release.sh ran with MORE=1: every embedded record, as benchmarks/sharegpt_cuts.py cuts them; --trainer twin
for the drafter of release.sh's TWIN_VOCAB training)

UNPACKED: release.tgz unpacked (release-smollm2/{run.json,0*_*/result.json,02_train/drafter}, train.json,
conversation_ids.json), with the serving's summary.json (release.sh serve) or summary-compare.json (compare) beside.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

STAGES = ("00_prepare", "01_extract", "02_train")


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("unpacked", type=Path)
    ap.add_argument(
        "--sharegpt", type=Path, nargs="+", required=True, help="the ShareGPT files the H200 read, in order"
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--git-note", default=None, help="what the H200's tree held beyond run.json's commit, if dirty")
    ap.add_argument(
        "--trainer",
        choices=("release", "twin"),
        default="release",
        help="which drafter: the run's, or the twin's (release.sh TWIN_VOCAB: the same 00_prepare, its own 02_train)",
    )
    args = ap.parse_args()
    src, out = args.unpacked, args.out
    run = src / "release-smollm2"
    trained = run if args.trainer == "release" else src / "twin" / "release-smollm2"
    results = {s: json.loads(((trained if s == "02_train" else run) / s / "result.json").read_text()) for s in STAGES}
    run_json = json.loads((run / "run.json").read_text())
    measured = json.loads((src / ("train.json" if args.trainer == "release" else "twin.json")).read_text())
    # release.sh serve's depths 1-5 where that call came back, else compare's depth 3 (this drafter's rows)
    served_file = src / "summary.json" if (src / "summary.json").exists() else src / "summary-compare.json"
    served = json.loads(served_file.read_text())
    served["rows"] = [r for r in served["rows"] if r["trainer"] == args.trainer]
    served["means"] = [m for m in served["means"] if m["trainer"] == args.trainer]
    ids = json.loads((src / "conversation_ids.json").read_text())

    out.mkdir(parents=True, exist_ok=True)
    drafter = trained / "02_train" / "drafter"
    for name in ("config.json", "eagle3.json"):
        shutil.copy(drafter / name, out / name)
    # bf16: half the bytes of the fp32 master weights; SGLang served it in bf16 (the target's dtype there)
    tensors = load_file(str(drafter / "model.safetensors"))
    save_file(
        {k: v.bfloat16() if v.is_floating_point() else v for k, v in tensors.items()}, str(out / "model.safetensors")
    )
    (out / "conversations.json").write_text(
        json.dumps({k: ids[k] for k in ("train", "val", "bench")}, separators=(",", ":")) + "\n"
    )

    # release.sh compare: this drafter and the one it replaces on the same prompts (30 a set at depth 3), with
    # al_interval.py's ratio where it ran
    compared = {}
    if (src / "summary-compare.json").exists():
        rows = json.loads((src / "summary-compare.json").read_text())["rows"]
        if (src / "summary-shipped.json").exists():
            rows += json.loads((src / "summary-shipped.json").read_text())["rows"]
        for r in rows:
            if r.get("served_al") is not None and r["set"] != "val":
                compared.setdefault(r["trainer"], {})[r["set"]] = round(r["served_al"], 4)
        if (src / "compare-ratio.txt").exists():
            compared["ratio_to_shipped"] = (src / "compare-ratio.txt").read_text().strip()
    prepare, train = results["00_prepare"]["figures"], results["02_train"]["figures"]
    by_depth = {}
    for row in served["rows"]:
        if row.get("served_al") is not None:
            by_depth.setdefault(str(row["depth"]), {})[row["set"]] = round(row["served_al"], 4)
    provenance = {
        "what": "EAGLE-3 drafter for SmolLM2-135M-Instruct (the embedded target), trained on an H200 by "
        "params/smollm2-135m-gpu-release.yaml; params/smollm2-135m-cpu.yaml starts from it (train.init_from)",
        "params_file": "params/smollm2-135m-gpu-release.yaml",
        "command": measured["command"],
        "params": run_json["params"],
        "git": run_json["git"] | ({"note": args.git_note} if args.git_note else {}),
        "versions": run_json.get("versions"),
        "machine": run_json.get("machine"),
        "data": {
            "source": "embedded:sharegpt"
            + (", its first 7,000 records" if len(args.sharegpt) == 1 else ", every record")
            + ", as benchmarks/sharegpt_cuts.py writes them",
            "source_file_sha256": {f.name: sha256(f) for f in args.sharegpt},
            "read": {k: prepare["read"][k] for k in ("read", "kept", "skipped")},
            "kept_unseen": "params/smollm2-135m-cpu.yaml's val and bench conversations, by id and by prompt: "
            f"{sum(prepare['read']['kept_unseen'].values())} left out",
            "splits": prepare["splits"],
            "conversation_ids": "conversations.json",
            "regenerated": {  # none where the run kept ShareGPT's replies (data.regenerate.budget_tokens 0)
                k: prepare.get("regenerate", {}).get(k) for k in ("tokens_generated", "regenerated", "kept_original")
            },
            "tokens": prepare["tokens"],
        },
        "training": {
            "tokens_trained": train["tokens"],
            "steps": train["steps"],
            "train_seconds": train["train_seconds"],
            "train_tokens_per_s": train["train_tokens_per_s"],
            "dtype": train.get("dtype_auto"),
            "drafter_params": train["drafter_params"],
            "stage_seconds": {s: results[s]["seconds"] for s in STAGES},
            "gpu": ", ".join((run_json.get("machine") or {}).get("gpus") or ["unknown"]),
            "gpu_wall_s": measured["wall_s"],
            "gpu_peak_gib": measured["gpu_peak_gib"],
        },
        "offline": {
            "est_accept_len": train["eval"]["est_accept_len"],
            "cond_acc": [round(x, 4) for x in train["eval"]["cond_acc"]],
            "initial_est_accept_len": train["initial_eval"]["est_accept_len"],
        },
        "served": {
            "from": served_file.name,
            "engine": served["engine"],
            "max_tokens": served["max_tokens"],
            "sets": served["sets"],
            "greedy, concurrency 1, top-k 1": True,
            "accept_len_mean": {str(m["depth"]): round(m["served_al_mean"], 4) for m in served["means"]},
            "accept_len": by_depth,
        },
        **({"compared_with_shipped": compared} if compared else {}),
        "stored_dtype": "bfloat16",
        "files": {
            name: sha256(out / name)
            for name in ("config.json", "eagle3.json", "model.safetensors", "conversations.json")
        },
    }
    (out / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")
    print(json.dumps({k: provenance[k] for k in ("served", "files")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
