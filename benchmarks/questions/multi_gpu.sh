#!/usr/bin/env bash
# Issue 22 on a host of N GPUs (nvidia-h200-x4: N=4), one device call, from the repo root:
#   1. training: our step at 8,192 on packed rows (train_throughput.py --docs) on one GPU, then under torchrun on N,
#      each rank on its own rows with the gradients all-reduced; tokens/s, the scaling efficiency against N × one
#      GPU in the same call, and whether every rank ends with the same weights (rank_weight_digests_equal);
#   2. capture: the in-process SGLang capture of the random-weight Llama-3.1-8B target on one GPU, then tensor
#      parallel over N (extract_inprocess_check.sh MODE=tp), each against the same engine's plain prefill.
# Not here: the TP capture's per-layer agreement with the 1-GPU one (dummy weights differ under TP) and SGLang
# serving at --tp N (issue 22, item 3). Carry .gpu/sglang-bundle and .gpu/ip (benchmarks/h200/.cache/.gpu).
# JSON lines in $OUT/four_gpu.jsonl, the capture's reports in $OUT (extract_inprocess_check.sh).
set -uo pipefail
N=${N:-4}; OUT=${OUT:-$PWD/h200-out}; mkdir -p "$OUT"
DOCS=${DOCS:-benchmarks/h200/.cache/.gpu/ip/tokens.safetensors}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
ARGS="--seqs 8192 --compile-layer --checkpoint off --docs $DOCS"
python3 benchmarks/train_throughput.py $ARGS | grep '^{"config' > "$OUT/train_1gpu.json"
torchrun --standalone --nproc_per_node "$N" benchmarks/train_throughput.py $ARGS | grep '^{"config' > "$OUT/train_${N}gpu.json"
python3 - "$OUT/train_1gpu.json" "$OUT/train_${N}gpu.json" <<'PY' | tee -a "$OUT/four_gpu.jsonl"
import json, sys
one, many = (json.load(open(p))["results"][0] for p in sys.argv[1:])
print(json.dumps({"one_gpu": one["tokens_per_s"], "ranks": many["ranks"], "all_ranks": many["tokens_per_s"],
                  "scaling_efficiency": round(many["tokens_per_s"] / (many["ranks"] * one["tokens_per_s"]), 3),
                  "rank_weight_digests_equal": many.get("rank_weight_digests_equal")}))
PY
OUT=$OUT MODE=tp TP=$N bash benchmarks/h200/extract_inprocess_check.sh
