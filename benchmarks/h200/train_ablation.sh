#!/usr/bin/env bash
# Issue 6 on one H200: speculators 0.9.0 and our drafter's training step at seq 8192 in one run, one
# after the other on the same GPU, then what each of our switches is worth there, and long rows.
# Run from the repo root; .whl/ holds speculators 0.9.0 and the pure-Python packages it needs
# (benchmarks/README.md). JSON lines go to $OUT/ablation.jsonl, errors to $OUT/ablation.err.
set -uo pipefail
OUT=${OUT:-$PWD/h200-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/spec-site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/spec-site
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
# The GPU-only tests first (the loss kernel on CUDA, flex gradients): a failure there explains what follows.
python3 -m pytest -q -p no:cacheprovider tests/test_loss.py tests/test_drafter.py -k "flex or loss or chunked or scores or cuda" \
  > "$OUT/pytest_gpu.log" 2>&1
tail -n 3 "$OUT/pytest_gpu.log"
bench() { python3 benchmarks/train_throughput.py "$@" >> "$OUT/ablation.jsonl" 2>> "$OUT/ablation.err"; }
bench --impl speculators --seqs 8192
bench --seqs 8192                                   # ours as the trainer runs it: compiled loss kernel, fused AdamW
bench --seqs 8192 --eager-loss                      # without the compiled loss kernel
bench --seqs 8192 --freeze-lm-head                  # speculators' frozen lm_head: the same work as its step
bench --seqs 8192 --freeze-lm-head --compile-layer --profile
bench --seqs 32768,131072                           # long rows (checkpointing where needed)
grep -h '^{' "$OUT/ablation.jsonl"
