#!/usr/bin/env bash
# online's GPU plan (python -m benchmarks online gpu-plan smol|8b): online training (the capture beside the trainer,
# one GPU) against its two parts alone and against training from shards (benchmarks/questions/online.py): capture
# alone, train alone (from the captured states in memory), online, and the take-turns bound 1 / (1/capture + 1/train).
#   MODE=smol   SmolLM2: prepare + extract (hf, bf16), then the modes with the hf capture and with the sglang_inprocess
#               capture (SGLang's model runner in the trainer's process), into $OUT
#   MODE=8b     Llama-3.1-8B's shape (capture.sh's target: its config, SGLang's dummy weights; random embeddings, head
#               and norm written for the trainer), SmolLM2's tokenizer: prepare, then the sglang_inprocess modes
# BACKENDS="sglang_inprocess" for one of them; STAGE=0 leaves out the 02_train notebook's online run at the end;
# RAY=1 adds the Ray placement (a capture actor and a trainer actor on half of the GPU each; Ray in both
# environments); NO_PROCESS=1 leaves out the process placement; REPEAT (default 2): train alone and the thread's runs.
# SHAREGPT: the conversations (default the embedded set's first 2,000, of which CONV=1,500 are read).
# Every step runs in SGLang's interpreter: the target's fingerprint in 00_prepare's contract is then the one the
# trainer computes. The capture-process mode shares the one GPU with its trainer process, the states through host memory.
set -uo pipefail
mkdir -p "$WORK"
DATA_DIR=${DATA_DIR:-$WORK/data}  # the embedded ShareGPT cut (benchmarks/sharegpt_cuts.py), EAGLE's sets beside it
[ -f "$DATA_DIR/sharegpt-7000.json.xz" ] || "$E3_PYTHON" -m benchmarks.sharegpt_cuts "$DATA_DIR" --benchsets "${BENCHSETS:-../shared/benchsets}" > /dev/null || exit 3
W=$WORK; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
SGL=$SGLANG_PYTHON
FLAGS='[--attention-backend,triton,--sampling-backend,pytorch,--mem-fraction-static,"0.3"]'
NAME=online-${MODE:-smol}
params() {  # the run's params: ci.yaml's, on the GPU, SGLang's flags for the in-process capture
  $SGL -c "
import yaml
p = yaml.safe_load(open('tests/params/ci.yaml'))
p['run'].update(name='$NAME', output_root='$W')
p['target'].update(device='cuda', dtype='bfloat16')
p['data'].update(sources=['${SHAREGPT:-$DATA_DIR/sharegpt-2000.json.xz}'], max_conversations=${CONV:-1500}, max_seq_len=2048, val_fraction=0.02)
p['data']['regenerate'] = {'budget_tokens': 0}
p['extract'].update(batch_tokens=65536, shard_max_tokens=262144, max_minutes=None)  # sglang_inprocess refuses a cut split
p['train'].update(max_seq_len=4096, batch_rows=1, dtype='auto', online_queue_batches=4)
p['engine'] = {'name': 'sglang', 'python': '$SGL'}
p.pop('bench', None)
if '${MODE:-smol}' == '8b':
    p['target'].update(name='$WORK/llama8b', aux_layer_ids=None)
    p['train'].update(init_layer_from_target=False, draft_vocab_size=32000)
    p['extract']['batch_tokens'] = 32768
yaml.safe_dump(p, open('$W/$NAME.yaml', 'w'))" || exit 3
}
modes() {  # BACKEND [ARGS...]: the modes, one JSON line each into $OUT/modes.jsonl
  local backend=$1; shift
  $SGL -m benchmarks.questions.online --run-dir $W/$NAME --params $W/$NAME.yaml --tokens "${TOKENS:-600000}" \
    --backend "$backend" --set "engine.extra_args=$FLAGS" --out "$OUT/modes-$MODE-$backend.jsonl" ${RAY:+--ray} ${NO_PROCESS:+--no-process} "$@" \
    > "$OUT/$MODE-$backend.log" 2>&1; local rc=$?
  grep -v "Warning\|Loading\|it/s\]" "$OUT/$MODE-$backend.log" | tail -n 9; [ $rc = 0 ] || tail -n 30 "$OUT/$MODE-$backend.log"
}
MODE=${MODE:-smol}
if [ "$MODE" = 8b ]; then
  WORK=$WORK $SGL - <<'PY' || exit 4
import json, os, shutil, torch
from safetensors.torch import save_file
from eagle3lib import target
tok = target.embedded_target_dir(target.default_cache_dir())
# meta-llama/Llama-3.1-8B-Instruct's config.json (benchmarks/questions/llama3.1-8b-config.json); SGLang's dummy
# loader makes the weights on the GPU
llama8b = json.load(open("benchmarks/questions/llama3.1-8b-config.json"))
W8 = os.environ["WORK"] + "/llama8b"
os.makedirs(W8, exist_ok=True)
json.dump(llama8b, open(f"{W8}/config.json", "w"), indent=1)
for f in os.listdir(tok):  # the tokenizer's files, its chat template (chat_template.jinja) among them
    if f != "config.json" and f.endswith((".json", ".jinja", ".txt")):
        shutil.copy(f"{tok}/{f}", W8)
g = torch.Generator(device="cuda").manual_seed(0)  # the trainer reads these three; SGLang makes its own (dummy)
head = {k: (torch.randn(128256, 4096, generator=g, device="cuda") * 0.02).bfloat16().cpu()
        for k in ("model.embed_tokens.weight", "lm_head.weight")}
save_file(head | {"model.norm.weight": torch.ones(4096, dtype=torch.bfloat16)}, f"{W8}/model.safetensors")
print("llama8b head written")
PY
  params; FLAGS='[--attention-backend,triton,--sampling-backend,pytorch,--mem-fraction-static,"0.3",--load-format,dummy]'
  $SGL -m eagle3lib run $W/$NAME.yaml --to prepare > "$OUT/prepare-8b.log" 2>&1 || { tail -n 30 "$OUT/prepare-8b.log"; exit 4; }
  tail -n 3 "$OUT/prepare-8b.log"
  TOKENS=${TOKENS:-300000} modes sglang_inprocess --no-shards --repeat "${REPEAT:-2}"
else
  params
  $SGL -m eagle3lib run $W/$NAME.yaml --to extract > "$OUT/extract.log" 2>&1 || { tail -n 30 "$OUT/extract.log"; exit 4; }
  tail -n 4 "$OUT/extract.log"
  for b in ${BACKENDS:-sglang_inprocess hf}; do modes $b --repeat "${REPEAT:-2}" --reader-variants; done
fi
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
if [ "$MODE" = smol ] && [ "${STAGE:-1}" = 1 ]; then  # the notebook's path: 02_train with launch.launch starting the stage in SGLang's interpreter
  $SGL -m eagle3lib run $W/$NAME.yaml --only 02_train --set train.source=online --set extract.backend=sglang_inprocess \
    --set "engine.extra_args=$FLAGS" --set train.max_tokens=300000 > "$OUT/stage-online-sglang.log" 2>&1; rc=$?
  tail -n 6 "$OUT/stage-online-sglang.log"; cp $W/$NAME/02_train/sglang-online.log "$OUT/" 2>/dev/null
  [ $rc = 0 ] || { grep -v "it/s\]" "$OUT/stage-online-sglang.log" | tail -n 40; }
fi
