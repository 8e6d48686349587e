#!/usr/bin/env bash
# capture's GPU plan (python -m benchmarks capture gpu-plan MODE): SGLang's in-process extraction backend
# (eagle3lib/extract/sglang_inprocess.py, driven by benchmarks/capture_check.py inprocess in $SGLANG_PYTHON):
#   smol-check   SmolLM2's config with random weights: against hf on the same tokens (per layer, the layer probe)
#                and its capture over the same engine's plain prefill
#   smol         the same target on every sequence, no reference: capture over plain prefill, bf16 shards
#   8b-bf16/fp8  Llama-3.1-8B's config (llama3.1-8b-config.json beside this script), weights random (--load-format
#                dummy: nothing downloaded or saved), bf16 and fp8 shards: capture over plain prefill, bytes a token
#   MODE=long: 8b fp8 and bf16 over every sequence, then the smol check again.
#   MODE=tp TP=N: only the 8b fp8 capture on one GPU, then over N GPUs (multi_gpu.sh).
#   MODE=levers: the host's disk and sha256 speeds, then 8b bf16 with 1, 2 and 4 writer threads, fp8 and smol with 2.
#   MODE=server: the server backend (extract/sglang.py) against hf on SmolLM2's config, 24 sequences.
#   TP=N (2, 4, 8 on a host with N GPUs) adds 8b-tpN. Agreement with the 1-GPU capture needs the same weights in
#   both, which --load-format dummy does not give under tensor parallelism: not measured yet.
# The token file and the random targets are made in $WORK on the first run; reports in $OUT.
set -uo pipefail
mkdir -p "$OUT" "$WORK"
T=$WORK/tokens.safetensors
[ -f "$T" ] || "$E3_PYTHON" -m benchmarks.capture_check save-tokens "$T" --n 600 --max-seq-len 4096 > /dev/null || exit 3
[ -f "$WORK/smol/config.json" ] || "$E3_PYTHON" -m benchmarks.capture_check random-target "$WORK/smol" > /dev/null || exit 3
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
WORK=$WORK "$E3_PYTHON" - <<'PY' || exit 4
import json, os, shutil
work = os.environ["WORK"]
tok = f"{work}/smol"
# meta-llama/Llama-3.1-8B-Instruct's config.json (benchmarks/questions/llama3.1-8b-config.json); SGLang's dummy
# loader makes the weights on the GPU
llama8b = json.load(open("benchmarks/questions/llama3.1-8b-config.json"))
os.makedirs(f"{work}/llama8b", exist_ok=True)
json.dump(llama8b, open(f"{work}/llama8b/config.json", "w"), indent=1)
for f in ("tokenizer.json", "tokenizer_config.json"):  # SGLang loads one; the ids come from the token file
    shutil.copy(f"{tok}/{f}", f"{work}/llama8b")
PY
FLAGS="--attention-backend triton --sampling-backend pytorch --mem-fraction-static 0.5"
check() {  # NAME SECONDS ARGS...
  local name=$1 secs=$2; shift 2
  echo "=== $name"; local t0=$(date +%s)
  timeout "$secs" "$SGLANG_PYTHON" -m benchmarks.capture_check inprocess --tokens "$T" --out "$WORK/ip-$name" "$@" \
    > "$OUT/$name.log" 2>&1; local rc=$?
  cp "$WORK/ip-$name/compare.json" "$OUT/$name.json" 2>/dev/null
  "$E3_PYTHON" - "$OUT/$name.json" "$name" "$rc" "$(( $(date +%s) - t0 ))" <<'PY'
import json, sys
path, name, rc, wall = sys.argv[1:]
try:
    r = json.load(open(path))
except Exception:
    print(json.dumps({"check": name, "rc": int(rc), "wall_s": int(wall), "report": None})); sys.exit()
a = r.get("agreement") or {}
print(json.dumps({"check": name, "rc": int(rc), "wall_s": int(wall), "ok": r.get("ok"), "tp": r.get("tp"),
                  "writers": r.get("writers"),
                  "tokens": r.get("tokens"), **r.get("inprocess", {}),
                  "rel_rms": {k: v.get("rel_rms") for k, v in (a.get("layers") or {}).items()},
                  "argmax_agree": a.get("argmax_agree"),
                  "probe": [s.get("best") for s in (r.get("layer_probe") or {}).get("slots", [])]}))
PY
  [ $rc -ne 0 ] && tail -25 "$OUT/$name.log"
  rm -rf "$WORK/ip-$name"
}
disk() {  # the host's own limits: a 4 GB write with fsync, sha256 of 1 GB in memory, one 1 GB shard through write_shard
  echo "=== disk"
  WORK=$WORK "$E3_PYTHON" - <<'PY' | tee "$OUT/disk.json"
import hashlib, json, os, time, torch
from eagle3lib.extract import shards
d = os.environ["WORK"] + "/disk-probe"; os.makedirs(d, exist_ok=True)
buf = os.urandom(1 << 26)
t = time.perf_counter()
with open(f"{d}/raw", "wb") as f:
    for _ in range(64):
        f.write(buf)
    f.flush(); os.fsync(f.fileno())
raw = 64 * len(buf) / (time.perf_counter() - t)
t = time.perf_counter(); h = hashlib.sha256()
for _ in range(16):
    h.update(buf)
sha = 16 * len(buf) / (time.perf_counter() - t)
n = 32768
x = {"input_ids": torch.zeros(n, dtype=torch.int32), "loss_mask": torch.ones(n, dtype=torch.uint8),
     "aux_hidden": torch.randn(n, 3 * 4096).bfloat16(), "final_hidden": torch.randn(n, 4096).bfloat16(),
     "seq_starts": torch.tensor([0, n])}
t = time.perf_counter(); e = shards.write_shard(d, x, 0, [2, 16, 29]); s = time.perf_counter() - t
os.system(f"rm -rf {d}")
print(json.dumps({"raw_write_fsync_GB_s": round(raw / 1e9, 3), "sha256_GB_s": round(sha / 1e9, 3),
                  "write_shard_GB_s": round(e["bytes"] / s / 1e9, 3), "shard_GB": round(e["bytes"] / 1e9, 2)}))
PY
}
E8="--target $WORK/llama8b --n 240 --no-reference --dtype bfloat16 --batch-tokens 32768"
if [ "${MODE:-check}" = long ]; then  # every sequence (850k tokens): the last shards' write is a smaller share
  check 8b-fp8-long 200 --target $WORK/llama8b --no-reference --dtype bfloat16 --batch-tokens 32768 --store-dtype float8_e4m3fn -- $FLAGS --load-format dummy
  check 8b-bf16-long 200 --target $WORK/llama8b --no-reference --dtype bfloat16 --batch-tokens 32768 -- $FLAGS --load-format dummy
  check smol-check 150 --target "$WORK/smol" --n 64 --dtype bfloat16 -- $FLAGS
  exit 0
fi
if [ "${MODE:-check}" = tp ]; then  # tensor parallel against one GPU, the 8b target only (four_gpu.sh)
  check 8b-fp8 140 --target $WORK/llama8b --n 240 --no-reference --dtype bfloat16 --batch-tokens 32768 --store-dtype float8_e4m3fn -- $FLAGS --load-format dummy
  check 8b-fp8-tp$TP 240 --target $WORK/llama8b --n 240 --no-reference --dtype bfloat16 --batch-tokens 32768 --store-dtype float8_e4m3fn -- $FLAGS --load-format dummy --tp $TP
  exit 0
fi
if [ "${MODE:-check}" = server ]; then  # the server backend: two servers, then hf in this process
  timeout "${CHECK_S:-430}" "$SGLANG_PYTHON" -m benchmarks.capture_check sglang --target "$WORK/smol" --tokens "$T" \
    --n "${N:-24}" --out "$WORK/sglang-check" --dtype bfloat16 --engine-python "$SGLANG_PYTHON" \
    --extra-args "--attention-backend triton --sampling-backend pytorch --mem-fraction-static 0.3 --disable-decode-cuda-graph"
  cp "$WORK"/sglang-check/compare.json "$WORK"/sglang-check/*.log "$OUT/" 2>/dev/null
  exit 0
fi
if [ "${MODE:-check}" = levers ]; then  # what bounds the capture: the disk, the writer threads, the store dtype
  disk
  for w in 1 2 4; do check 8b-bf16-w$w 140 $E8 --writers $w -- $FLAGS --load-format dummy; done
  check 8b-fp8-w2 140 $E8 --writers 2 --store-dtype float8_e4m3fn -- $FLAGS --load-format dummy
  check smol-w2 100 --target "$WORK/smol" --no-reference --dtype bfloat16 --writers 2 -- $FLAGS
  exit 0
fi
check smol-check 150 --target "$WORK/smol" --n 64 --dtype bfloat16 -- $FLAGS
check smol 100 --target "$WORK/smol" --no-reference --dtype bfloat16 -- $FLAGS
check 8b-bf16 140 --target $WORK/llama8b --n 240 --no-reference --dtype bfloat16 --batch-tokens 32768 -- $FLAGS --load-format dummy
check 8b-fp8 140 --target $WORK/llama8b --n 240 --no-reference --dtype bfloat16 --batch-tokens 32768 --store-dtype float8_e4m3fn -- $FLAGS --load-format dummy
if [ "${TP:-1}" != 1 ]; then
  check 8b-tp$TP 240 --target $WORK/llama8b --n 240 --no-reference --dtype bfloat16 --batch-tokens 32768 -- $FLAGS --load-format dummy --tp $TP
fi
