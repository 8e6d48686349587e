#!/usr/bin/env bash
# train_step's GPU plan (python -m benchmarks train_step gpu-plan PLAN): speculators 0.9.0's training step and ours
# at seq 8192 on the same GPU, on rows of one document and on packed rows of real documents (--docs: a prepare-stage
# token file, default made here from the embedded ShareGPT split), what each of our switches is worth, long rows,
# and data parallel over the host's GPUs. speculators runs in $SPECULATORS_PYTHON, ours in $E3_PYTHON.
#   PART=1       the GPU-only tests and the headline table (speculators and ours on both kinds of rows, a profile)
#   PART=2       the ablations and the long row (SEQS_LONG, default 131072)
#   PART=all     both; PART=sweep: ours over SEQS (8192..131072) with a profile; PART=ddp: torchrun over the GPUs
# JSON lines go to stdout and $OUT/train_step.jsonl, errors to $OUT/train_step.err.
set -uo pipefail
mkdir -p "$OUT" "$WORK"
DOCS=${DOCS:-$WORK/tokens.safetensors}
PART=${PART:-all}
step() { "$E3_PYTHON" -m benchmarks.questions.train_step "$@" 2>> "$OUT/train_step.err" | tee -a "$OUT/train_step.jsonl"; }
peer() { "$SPECULATORS_PYTHON" -m benchmarks.questions.train_step "$@" 2>> "$OUT/train_step.err" | tee -a "$OUT/train_step.jsonl"; }
if [ ! -f "$DOCS" ]; then
  "$E3_PYTHON" -m benchmarks.capture_check save-tokens "$DOCS" --n 600 --max-seq-len 4096 > /dev/null || exit 3
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
SAME="--seqs 8192 --freeze-lm-head --compile-layer --checkpoint off"  # speculators' work: its lm_head frozen
if [ "$PART" = 1 ] || [ "$PART" = all ]; then
  # the GPU-only tests first (the loss kernel on CUDA, flex gradients, the merged attention's paths): a failure
  # there explains what follows
  "$E3_PYTHON" -m pytest -q -p no:cacheprovider tests/unit/test_loss.py tests/unit/test_drafter.py tests/gpu \
    -k "flex or loss or chunked or scores or cuda or merged or varlen or gpus or ttt" > "$OUT/pytest_gpu.log" 2>&1
  tail -n 3 "$OUT/pytest_gpu.log"
  peer --impl speculators --seqs 8192
  peer --impl speculators --seqs 8192 --docs "$DOCS"
  step $SAME                              # one document: merged on cuDNN
  step $SAME --docs "$DOCS" --profile     # packed: merged on flash varlen, with a kernel breakdown
  step --seqs 8192 --compile-layer --checkpoint off --docs "$DOCS"   # as the trainer runs by default
fi
if [ "$PART" = 2 ] || [ "$PART" = all ]; then
  step $SAME --docs "$DOCS" --attention flex   # packed rows as before: flex_attention
  step $SAME --docs "$DOCS" --all-rows         # the loss scoring every position
  step $SAME --attention varlen                # one document through flash varlen instead of cuDNN
  step --seqs 8192 --compile-layer --checkpoint off   # one document, lm_head trained
  step --seqs "${SEQS_LONG:-131072}" --compile-layer   # checkpointing where needed
fi
if [ "$PART" = sweep ]; then
  step --impl ours --seqs "${SEQS:-8192,16384,32768,65536,131072}" --profile
  step --impl ours --seqs 8192 --freeze-lm-head
fi
if [ "$PART" = ddp ]; then  # data parallel over every visible GPU at 8192: the gradient all-reduce's scaling
  N=$(nvidia-smi -L | wc -l)
  "$(dirname "$E3_PYTHON")/torchrun" --standalone --nproc_per_node "$N" -m benchmarks.questions.train_step --impl ours \
    --seqs 8192 --docs "$DOCS" 2>> "$OUT/train_step.err" | grep '^{' | tee -a "$OUT/train_step.jsonl"
fi
