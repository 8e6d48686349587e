#!/usr/bin/env bash
# Issue 6 on a 2×H200 host: our drafter's training throughput against speculators 0.9.0 in one run,
# long sequences, and 2-GPU data parallel. Run from the repo root; results go to $OUT (or ./h200-out).
#   .whl/  speculators 0.9.0 and the pure-Python packages it needs (benchmarks/README.md says how to fetch them)
set -uo pipefail
OUT=${OUT:-$PWD/h200-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/spec-site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/spec-site
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
SEQS=${SEQS:-8192,16384,32768,65536,131072}
# The two implementations side by side, one GPU each, same process settings. On GPU 0 after our sweep:
# ours at 8192 with speculators' frozen lm_head (the same work), then with the layer compiled as well.
ours() {
  python3 benchmarks/train_throughput.py --impl ours --seqs "$SEQS" --profile
  python3 benchmarks/train_throughput.py --impl ours --seqs 8192 --freeze-lm-head
  timeout 200 python3 benchmarks/train_throughput.py --impl ours --seqs 8192 --freeze-lm-head --compile-layer --checkpoint off
}
CUDA_VISIBLE_DEVICES=0 timeout ${JOB_S:-470} bash -c "$(declare -f ours); SEQS=$SEQS ours" > "$OUT/ours.jsonl" 2> "$OUT/ours.err" &
CUDA_VISIBLE_DEVICES=1 timeout ${JOB_S:-470} python3 benchmarks/train_throughput.py --impl speculators --seqs "$SEQS" > "$OUT/speculators.jsonl" 2> "$OUT/speculators.err" &
wait
tail -n 3 "$OUT"/ours.err "$OUT"/speculators.err
# Data parallel over both GPUs at 8192 (the trainer's gradient all-reduce), for the scaling efficiency.
torchrun --nproc_per_node 2 benchmarks/train_throughput.py --impl ours --seqs 8192 > "$OUT/ddp2.jsonl" 2> "$OUT/ddp2.err"
tail -n 3 "$OUT/ddp2.err"
python3 -m pytest -q -p no:cacheprovider tests/unit/test_drafter.py tests/unit/test_loss.py -k "flex or loss or chunked or scores" 2>&1 | tail -n 3
grep -h '^{' "$OUT"/*.jsonl
