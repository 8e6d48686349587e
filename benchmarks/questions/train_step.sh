#!/usr/bin/env bash
# Training throughput on one H200: speculators 0.9.0 and our drafter's training step at seq 8192, one after the
# other on the same GPU, on rows of one document and on packed rows of real documents (train_throughput.py --docs:
# the embedded ShareGPT split's sequences, packed as the trainer packs them), then what each of our switches is
# worth there, and long rows.
# Run from the repo root. $WHEELS (default .whl) holds speculators 0.9.0 and the pure-Python packages it needs
# (benchmarks/README.md); $DOCS a prepare-stage token file (default: the one extract_inprocess_check.sh carries,
# 600 ShareGPT conversations through SmolLM2's chat template). JSON lines go to $OUT/ablation.jsonl, errors to
# $OUT/ablation.err. PART=1: the GPU-only tests and the headline table (speculators and ours on both kinds of
# rows, a profile of ours on packed rows); PART=2: the ablations and the long row (SEQS_LONG, default 131072);
# PART=all (default) both, which takes longer than one 600 s device call.
set -uo pipefail
OUT=${OUT:-$PWD/h200-out}; mkdir -p "$OUT"
WHEELS=${WHEELS:-.whl}
DOCS=${DOCS:-benchmarks/h200/.cache/.gpu/ip/tokens.safetensors}
PART=${PART:-all}
[ -f "$DOCS" ] || { echo "no token file $DOCS: set DOCS (benchmarks/h200/extract_inprocess_check.sh says how to make one)" >&2; exit 2; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls "$WHEELS"/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/spec-site "$WHEELS"/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/spec-site
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
bench() { python3 benchmarks/train_throughput.py "$@" >> "$OUT/ablation.jsonl" 2>> "$OUT/ablation.err"; }
SAME="--seqs 8192 --freeze-lm-head --compile-layer --checkpoint off"  # speculators' work: its lm_head frozen
if [ "$PART" = 1 ] || [ "$PART" = all ]; then
  # The GPU-only tests first (the loss kernel on CUDA, flex gradients, cuDNN's and flash varlen's merged attention
  # against the dense path): a failure there explains what follows.
  python3 -m pytest -q -p no:cacheprovider tests/unit/test_loss.py tests/unit/test_drafter.py \
    -k "flex or loss or chunked or scores or cuda or merged or varlen or gpus" > "$OUT/pytest_gpu.log" 2>&1
  tail -n 3 "$OUT/pytest_gpu.log"
  bench --impl speculators --seqs 8192
  bench --impl speculators --seqs 8192 --docs "$DOCS"
  bench $SAME                              # one document: merged on cuDNN
  bench $SAME --docs "$DOCS" --profile     # packed: merged on flash varlen, with a kernel breakdown
  bench --seqs 8192 --compile-layer --checkpoint off --docs "$DOCS"   # as the trainer runs by default (lm_head trained)
fi
if [ "$PART" = 2 ] || [ "$PART" = all ]; then
  bench $SAME --docs "$DOCS" --attention flex   # packed rows as before: flex_attention
  bench $SAME --docs "$DOCS" --all-rows         # the loss scoring every position
  bench $SAME --attention varlen                # one document through flash varlen instead of cuDNN
  bench --seqs 8192 --compile-layer --checkpoint off   # one document, lm_head trained
  bench --seqs "${SEQS_LONG:-131072}" --compile-layer   # checkpointing where needed
fi
grep -h '^{' "$OUT/ablation.jsonl"
