#!/usr/bin/env bash
# multi_gpu's plan on a host of N GPUs (not measured yet): (1) training, our step at 8,192 on packed rows on one
# GPU, then under torchrun on N, each rank on its own rows with the gradients all-reduced: tokens/s, the scaling
# efficiency against N x one GPU, and whether every rank ends with the same weights; (2) capture, SGLang's in-process
# capture of Llama-3.1-8B's shape on one GPU, then tensor parallel over N (capture.sh MODE=tp).
set -uo pipefail
N=${N:-4}; mkdir -p "$OUT" "$WORK"
DOCS=${DOCS:-$WORK/tokens.safetensors}
[ -f "$DOCS" ] || "$E3_PYTHON" -m benchmarks.capture_check save-tokens "$DOCS" --n 600 --max-seq-len 4096 > /dev/null || exit 3
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
ARGS="--seqs 8192 --compile-layer --checkpoint off --docs $DOCS"
"$E3_PYTHON" -m benchmarks.questions.train_step $ARGS | grep '^{"config' > "$OUT/train_1gpu.json"
"$(dirname "$E3_PYTHON")/torchrun" --standalone --nproc_per_node "$N" -m benchmarks.questions.train_step $ARGS \
  | grep '^{"config' > "$OUT/train_${N}gpu.json"
"$E3_PYTHON" - "$OUT/train_1gpu.json" "$OUT/train_${N}gpu.json" <<'PY'
import json, sys
one, many = (json.load(open(p))["results"][0] for p in sys.argv[1:])
print(json.dumps({"one_gpu": one["tokens_per_s"], "ranks": many["ranks"], "all_ranks": many["tokens_per_s"],
                  "scaling_efficiency": round(many["tokens_per_s"] / (many["ranks"] * one["tokens_per_s"]), 3),
                  "rank_weight_digests_equal": many.get("rank_weight_digests_equal")}))
PY
MODE=tp TP=$N bash benchmarks/questions/capture.sh
