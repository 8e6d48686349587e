#!/usr/bin/env bash
# Issue 33 on one H200: online training (the capture in a thread beside the trainer, one GPU) against training from
# shards and the capture alone, in one call: the take-turns bound 1 / (1/capture + 1/train) and online's share of it.
# Staging as peers.sh's (stage1's pyd, stage2, stage3: the target, papermill, the ShareGPT file), then:
#   bash benchmarks/h200/online.sh        prepare + extract (hf, bf16) and benchmarks/online_throughput.py, into $OUT
# (The capture-process mode needs a GPU per rank: left out on one GPU.)
set -uo pipefail
W=/tmp/online; OUT=${OUT:-$PWD/h200-out}; mkdir -p "$OUT" $W
export PYTHONPATH=$PWD:/tmp/e3site:/tmp/pm-site:/tmp/extra-site JUPYTER_PATH=/tmp/pm-site/share/jupyter \
  HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
python3 -c "
import yaml
p = yaml.safe_load(open('params/ci.yaml'))
p['run'].update(name='online-gpu', output_root='$W')
p['target'].update(device='cuda', dtype='bfloat16')
p['data'].update(sources=['/tmp/data/sharegpt-7000.json.xz'], max_conversations=${CONV:-1500}, max_seq_len=2048, val_fraction=0.02)
p['data']['regenerate'] = {'budget_tokens': 0}
p['extract'].update(batch_tokens=65536, shard_max_tokens=262144)
p['train'].update(max_seq_len=4096, batch_rows=1, dtype='auto', online_queue_batches=4)
p['engine'] = {'name': 'sglang'}
p.pop('bench', None)
yaml.safe_dump(p, open('$W/online-gpu.yaml', 'w'))" || exit 3
python3 -m eagle3lib run $W/online-gpu.yaml --to extract > "$OUT/extract.log" 2>&1 || { tail -n 30 "$OUT/extract.log"; exit 4; }
tail -n 4 "$OUT/extract.log"
python3 benchmarks/online_throughput.py --run-dir $W/online-gpu --params $W/online-gpu.yaml --tokens "${TOKENS:-600000}" \
  --no-process --out "$OUT/modes.jsonl" 2>&1 | grep -v Warning | tail -n 12
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
