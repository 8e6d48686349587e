#!/usr/bin/env bash
# kimi_tiny_sglang's GPU plan (python -m benchmarks kimi_tiny_sglang gpu-plan prep|serve): SGLang serving a tiny
# random-weight copy of Kimi-K2.5 (DeepseekV3ForCausalLM: MLA with Kimi's 512 + 64 latent, 8 MoE experts, YaRN;
# eagle3lib/target/tiny.py) with an EAGLE-3 export of this project, token ids in and out (--skip-tokenizer-init:
# SGLang cannot load Kimi's tokenizer without its remote code); without and with speculation (depth 3), the same
# prompts. Random weights: the check is that the launch works, the drafter binds and the engine verifies drafts
# (spec_verify_ct), not the acceptance.
#   prep RUN_DIR [TARGET_WEIGHTS]   RUN_DIR: a finished params/kimi-k2.5-tiny-cpu.yaml run to 03_convert; Kimi's
#                                   config, tiktoken.model, template and tokenizer config ($KIMI_FIXTURES) and the
#                                   run's SGLang export into $WORK/kimi-tiny
#   serve                           the two servers, in $SGLANG_PYTHON
# DTYPE=float16: the losslessness check (in bf16 4 of 5 replies parted at near-ties of the random weights, in fp16 1
# of 5). float32 does not start: sgl_kernel's rmsnorm, which SGLang 0.5.17's DeepSeek layers call, has no fp32 kernel.
set -uo pipefail
mkdir -p "$WORK"; G=$WORK/kimi-tiny
if [ "${1:-serve}" = prep ]; then
  F=${KIMI_FIXTURES:-../shared/fixtures/kimi-k2.5}; rm -rf $G; mkdir -p $G/kimi $G/draft
  cp $F/config.json $F/tiktoken.model $F/chat_template.jinja $F/k2-instruct/tokenizer_config.json $G/kimi/
  cp -r "$2"/03_convert/sglang/* $G/draft/
  [ -f "${3:-}" ] && sha256sum "$3" | cut -d' ' -f1 > $G/target.sha256  # TARGET_WEIGHTS: the run's tiny target
  RUN_DIR=$2 .venv/bin/python - <<'PY'
import json
import os
from eagle3lib import target
tok = target.load_tokenizer(os.environ["G"] + "/kimi")
import os, pathlib
prompts = [[{"role": "user", "content": p}] for p in
           ["What is 2+2? Answer briefly.", "Write a haiku about autumn.", "List three prime numbers."]]
bench = pathlib.Path(os.environ["RUN_DIR"]) / "00_prepare" / "bench.jsonl"  # the run's held-out prompts too
prompts += [json.loads(line)["messages"] for line in bench.read_text().splitlines() if line.strip()]
ids = [tok.apply_chat_template(m, add_generation_prompt=True) for m in prompts]
json.dump(ids, open(os.environ["G"] + "/prompts.json", "w"))
PY
  exit 0
fi
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
T=$("$E3_PYTHON" -c "from eagle3lib.target import tiny; print(tiny.build('$G/kimi', '$WORK/tinycache'))") || exit 5
echo "tiny target: $T"; sha256sum "$T"/*.safetensors  # the same weights as the CPU's copy the drafter trained on?
[ -f $G/target.sha256 ] && echo "the CPU's copy: $(cat $G/target.sha256)"
"$E3_PYTHON" -c "import json;c=json.load(open('$T/config.json'));print({k:c[k] for k in ('architectures','hidden_size','num_hidden_layers','kv_lora_rank','qk_rope_head_dim','n_routed_experts','vocab_size')})"
COMMON="--model-path $T --host 127.0.0.1 --port 30000 --attention-backend triton --sampling-backend pytorch --mem-fraction-static 0.3 --context-length 2048 --disable-cuda-graph --skip-tokenizer-init --dtype ${DTYPE:-bfloat16}"
for mode in base spec; do
  ARGS="$COMMON"; [ $mode = spec ] && ARGS="$ARGS --speculative-algorithm EAGLE3 --speculative-draft-model-path $G/draft --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
  t0=$(date +%s); "$SGLANG_PYTHON" -m sglang.launch_server $ARGS > $OUT/sglang-$mode.log 2>&1 & PID=$!
  ok=0; for i in $(seq 1 180); do curl -sf 127.0.0.1:30000/health >/dev/null && { ok=1; break; }; kill -0 $PID 2>/dev/null || break; sleep 2; done
  echo "$mode: healthy=$ok after $(( $(date +%s) - t0 )) s"
  if [ $ok = 1 ]; then G=$G WORK=$WORK "$E3_PYTHON" - $mode <<'PY'
import json, os, sys, time, urllib.request
mode = sys.argv[1]
out = []
for ids in json.load(open(os.environ["G"] + "/prompts.json")):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}
    t = time.time()
    r = json.load(urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:30000/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})))
    m = r["meta_info"]
    out.append({"ids": r.get("output_ids"), "s": round(time.time() - t, 3), **{k: m.get(k) for k in ("completion_tokens", "spec_verify_ct", "spec_accept_length", "spec_num_proposed_drafts", "spec_num_correct_drafts")}})
print(json.dumps({"mode": mode, "results": out}))
json.dump(out, open(os.environ["WORK"] + f"/kimi-{mode}.json", "w"))
PY
  else tail -40 $OUT/sglang-$mode.log; fi
  kill $PID; wait $PID 2>/dev/null; sleep 3
done
cp "$WORK"/kimi-base.json "$WORK"/kimi-spec.json "$OUT"/ 2>/dev/null  # both runs' ids
WORK=$WORK "$E3_PYTHON" - <<'PY'
import json, os
try:
    b, s = json.load(open(os.environ["WORK"] + "/kimi-base.json")), json.load(open(os.environ["WORK"] + "/kimi-spec.json"))
    print("same output ids with and without speculation:", [x["ids"] == y["ids"] for x, y in zip(b, s)])
except OSError as e:
    print("no comparison:", e)
PY
