#!/usr/bin/env bash
# cost_model's GPU plan: params/smollm2-135m-gpu.yaml through 05_benchmark on one GPU (its drafter served by SGLang,
# the benchmark's cost model choosing the depths: speedup/cost.py, sweep.choose_and_measure), then the cost model
# replayed on what it measured. Finished stages are skipped, so a run cut short goes on where it stopped.
#   TO: the last stage (default benchmark); BUDGET_S: the run's time limit; SETS: more --set overrides for the run
set -uo pipefail
mkdir -p "$OUT" "$WORK"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
# shellcheck disable=SC2086  # SETS is a list of --set arguments
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} timeout -k 30 "${BUDGET_S:-36000}" "$E3_PYTHON" -m eagle3lib run \
  params/smollm2-135m-gpu.yaml --to "${TO:-benchmark}" --set run.output_root="$WORK" \
  --set engine.python="$ROOT/benchmarks/gpu_host/sglang-python" ${SETS:-} > "$OUT/run.log" 2>&1; rc=$?
tail -n 25 "$OUT/run.log"
RUN=$(ls -d "$WORK"/*/05_benchmark 2>/dev/null | head -1)
[ -n "$RUN" ] || { echo "no 05_benchmark in $WORK (exit $rc)"; exit "${rc:-1}"; }
RUN=$(dirname "$RUN")
( cd "$RUN" && tar -cJf "$OUT/run.tar.xz" */result.json 02_train/train_summary.json */*.html */*.log 2>/dev/null )
"$E3_PYTHON" -m benchmarks.questions.cost_model "$RUN"
