#!/usr/bin/env bash
# Issue 8 on an H200: the sglang extraction backend against hf on the same tokens (per-layer differences,
# the off-by-one layer probe, capture and plain-prefill tokens/s); prints JSON, writes $OUT/compare.json.
# Prepare here (no GPU):
#   .venv/bin/python benchmarks/extract_check.py save-tokens .gpu/check_tokens.safetensors --n 64
#   mkdir -p .gpu/tok && cp ~/.cache/eagle3-workbook/smollm2-135m-instruct/{config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} .gpu/tok/
# There: BUNDLE=.gpu/sglang-bundle bash benchmarks/h200/extract_sglang_check.sh   (carry .gpu/sglang-bundle,
# .gpu/tok, .gpu/check_tokens.safetensors). With no SmolLM2 weights on the host, the target is a random-weight
# Llama of SmolLM2's config with $LAYERS layers: enough to check formats, row counts and layer ids.
set -uo pipefail
OUT=${OUT:-$PWD/h200-out}; mkdir -p "$OUT"
if [ ! -f /tmp/sglang-site/.complete ]; then
  mkdir -p /tmp/sglang-site && for t in "${BUNDLE:-.gpu/sglang-bundle}"/site*.tar.xz; do tar -C /tmp/sglang-site -xJf "$t" || exit 3; done
  touch /tmp/sglang-site/.complete
fi
export PYTHONPATH=/tmp/sglang-site:$PWD PATH=/tmp/sglang-site/bin:$PATH HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
TARGET=${TARGET:-/tmp/tiny-target}
if [ ! -f "$TARGET/config.json" ]; then
  LAYERS=${LAYERS:-30} TARGET=$TARGET python3 - <<'PY'
import json, os, shutil, torch, transformers
cfg = json.load(open(".gpu/tok/config.json"))
cfg.update(num_hidden_layers=int(os.environ["LAYERS"]))
keep = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version", "_model_name_or_path", "dtype")}
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**keep)).to(torch.bfloat16)
model.save_pretrained(os.environ["TARGET"])
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(".gpu/tok/" + f, os.path.join(os.environ["TARGET"], f))
PY
fi
EXTRA="--attention-backend triton --sampling-backend pytorch --mem-fraction-static 0.3 --disable-decode-cuda-graph"
timeout "${CHECK_S:-430}" python3 benchmarks/extract_check.py sglang --target "$TARGET" \
  --tokens .gpu/check_tokens.safetensors --n "${N:-24}" --out /tmp/sglang-check --dtype bfloat16 \
  --engine-python python3 --extra-args "$EXTRA"
cp /tmp/sglang-check/compare.json /tmp/sglang-check/*.log "$OUT/" 2>/dev/null
