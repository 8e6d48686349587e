#!/usr/bin/env bash
# bench_sets' GPU plan (python -m benchmarks bench_sets gpu-plan prep|bench): a finished CPU run's drafter
# (params/smollm2-135m-cpu.yaml: its bench split, 02_train and 03_convert) served by SGLang with
# params/smollm2-135m-gpu.yaml's engine, 05_benchmark on all six of EAGLE's question sets: held_out, mt_bench and
# humaneval (their packages, in .venv) and gsm8k, alpaca, sum, qa (question.jsonl files from $BENCHSETS).
#   prep RUN_DIR [BENCHSETS]   the run's bench.jsonl, results and drafter, and the sets' files, into $WORK/sets
#   bench                      05_benchmark on every set (NAME=... SET="--set bench.temperature=0.7 ...": another sweep)
set -uo pipefail
mkdir -p "$OUT" "$WORK"
R=$WORK/sets
if [ "${1:-}" = prep ]; then
  RUN=${2:?usage: bench_sets.sh prep RUN_DIR [BENCHSETS]}; B=${3:-${BENCHSETS:-../shared/benchsets}}
  rm -rf "$R" && mkdir -p "$R"/run/00_prepare "$R"/run/02_train "$R"/run/03_convert "$R"/benchsets || exit 3
  cp "$RUN"/00_prepare/bench.jsonl "$RUN"/00_prepare/result.json "$R"/run/00_prepare/ || exit 3
  cp -r "$RUN"/02_train/result.json "$RUN"/02_train/drafter "$R"/run/02_train/ || exit 3
  cp "$RUN"/03_convert/result.json "$R"/run/03_convert/ && cp "$RUN"/run.json "$R"/run/ || exit 3
  for s in gsm8k alpaca sum qa; do mkdir -p "$R"/benchsets/$s && cp "$B"/$s/question.jsonl "$R"/benchsets/$s/ || exit 3; done
  du -sh "$R"; exit 0
fi
[ "${1:-bench}" = bench ] || { echo "usage: bench_sets.sh prep RUN_DIR [BENCHSETS] | bench" >&2; exit 2; }
[ -d "$R/run" ] || { echo "no run in $R: run the prep step first" >&2; exit 3; }
NAME=${NAME:-run}; RUN=$R/$NAME
[ -d "$RUN" ] || cp -r "$R"/run "$RUN"
# the SGLang export of the run's drafter, made here (the same code as the convert stage), and the result naming it
"$E3_PYTHON" - "$RUN" <<'PY' || exit 6
import json, sys
from pathlib import Path
from eagle3lib import target
from eagle3lib.convert import layouts
run = Path(sys.argv[1]); cache = target.default_cache_dir()
tdir = target.embedded_target_dir(cache)
out = layouts.export(run / "02_train" / "drafter", "sglang", run / "03_convert" / "sglang", target=str(tdir), cache_dir=cache)
res = json.loads((run / "03_convert" / "result.json").read_text())
res["figures"]["exports"] = {"sglang": str(out)}
(run / "03_convert" / "result.json").write_text(json.dumps(res, indent=2))
print("sglang export:", out)
PY
S=$R/benchsets
# shellcheck disable=SC2086  # SET is a list of --set arguments
timeout -k 20 "${BUDGET_S:-3600}" "$E3_PYTHON" -m eagle3lib run params/smollm2-135m-gpu.yaml --only benchmark \
  --set run.name="$NAME" --set run.output_root="$R" --set engine.python="$ROOT/benchmarks/gpu_host/sglang-python" \
  --set "bench.prompts=[held_out, mt_bench, humaneval, $S/gsm8k/question.jsonl, $S/alpaca/question.jsonl, $S/sum/question.jsonl, $S/qa/question.jsonl]" \
  ${SET:-} > "$OUT/bench_$NAME.log" 2>&1
echo "exit $?"; tail -n 30 "$OUT/bench_$NAME.log"
( cd "$RUN" && tar -cJf "$OUT/bench_$NAME.tar.xz" 05_benchmark/result.json 05_benchmark/*.html 05_benchmark/*.png \
    05_benchmark/*.log index.html 2>/dev/null )
"$E3_PYTHON" - "$RUN" <<'PY'
import json, sys
r = json.loads(open(f"{sys.argv[1]}/05_benchmark/result.json").read())
print(r.get("status"), json.dumps(r.get("headline")), str(r.get("error", ""))[:600])
f = r.get("figures", {})
for t in (f.get("sets") or {}).get("tables", []):
    for s in t["sets"]:
        print(t["concurrency"], s["set"], s["prompts"], {d: (c["accept_len"] and round(c["accept_len"], 2), c["speedup"] and round(c["speedup"], 2), c["predicted_accept_len"] and round(c["predicted_accept_len"], 2)) for d, c in s["cells"].items()})
print(json.dumps((f.get("sampling") or {}), default=str)[:1500])
PY
