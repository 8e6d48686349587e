#!/usr/bin/env bash
# Issue 6 on one H200: speculators 0.9.0 and our drafter's training step at seq 8192 in one run, one
# after the other on the same GPU, then what each of our switches is worth there, and long rows.
# Run from the repo root. $WHEELS (default .whl) holds speculators 0.9.0 and the pure-Python packages it
# needs (benchmarks/README.md), and torchao for --float8. JSON lines go to $OUT/ablation.jsonl, errors to
# $OUT/ablation.err. LONG=0 leaves out the long rows (a separate call: SEQS_LONG=32768,131072).
set -uo pipefail
OUT=${OUT:-$PWD/h200-out}; mkdir -p "$OUT"
WHEELS=${WHEELS:-.whl}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls "$WHEELS"/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/spec-site "$WHEELS"/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/spec-site
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
bench() { python3 benchmarks/train_throughput.py "$@" >> "$OUT/ablation.jsonl" 2>> "$OUT/ablation.err"; }
if [ "${ONLY_LONG:-0}" != 1 ]; then
  # The GPU-only tests first (the loss kernel on CUDA, flex gradients, cuDNN's merged attention against the
  # dense path, FP8): a failure there explains what follows.
  python3 -m pytest -q -p no:cacheprovider tests/test_loss.py tests/test_drafter.py tests/test_float8.py \
    -k "flex or loss or chunked or scores or cuda or merged or float8" > "$OUT/pytest_gpu.log" 2>&1
  tail -n 3 "$OUT/pytest_gpu.log"
  bench --impl speculators --seqs 8192
  # The same work as speculators' step (its lm_head frozen), layer compiled: flex attention, then the
  # default on these one-document rows (cuDNN causal ⊕ diagonals, the merge compiled; with a kernel
  # breakdown of one step), the same with the merge eager, then with FP8 matmuls.
  bench --seqs 8192 --freeze-lm-head --compile-layer --checkpoint off --attention flex
  bench --seqs 8192 --freeze-lm-head --compile-layer --checkpoint off --profile
  bench --seqs 8192 --freeze-lm-head --compile-layer --checkpoint off --eager-merge
  bench --seqs 8192 --freeze-lm-head --compile-layer --checkpoint off --float8
  # As the trainer runs by default (lm_head trained), with the layer compiled, and with FP8 too.
  bench --seqs 8192 --compile-layer --checkpoint off
  bench --seqs 8192 --compile-layer --checkpoint off --float8
fi
[ "${LONG:-1}" = 1 ] && bench --seqs "${SEQS_LONG:-32768,131072}" --compile-layer   # checkpointing where needed
grep -h '^{' "$OUT/ablation.jsonl"
