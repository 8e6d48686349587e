#!/usr/bin/env bash
# release's GPU plan (python -m benchmarks release gpu-plan STEP): the released drafter for the embedded target
# (params/smollm2-135m-gpu-release.yaml), trained from the embedded ShareGPT data less params/smollm2-135m-cpu.yaml's
# val and bench conversations, served by SGLang at depths 1-5 for its provenance, and packed as the canonical
# checkpoint and the records behind provenance.json. Steps:
#   train           the run (regeneration, extraction, training) in the background (TO=prepare: the regeneration only)
#   wait            until it ends (WAIT_S at most; exit 9 while it runs), then `bring`'s archive into $OUT
#   bring-prepared  after TO=prepare: 00_prepare into $OUT; carried back as $G/release-prepared, train skips it
#   serve           served and predicted AL per set at depths 1, 2, 3, 5 (summary.json)
#   shipped         the shipped drafter's served AL at depth 3 on compare's prompts, once train's 00_prepare ended
#   compare         served AL at depth 3 against the shipped drafter, seven sets (summary-compare.json, and the ratio
#                   with its interval from benchmarks/al_interval.py)
#   bring           the drafter and its records, one archive (release.tgz), into $OUT
# MORE=1: every embedded conversation less the default run's val and bench, REGEN_MIN minutes of regeneration,
# TRAIN_MIN of training, online (ONLINE=0: fp8 shards). VOCAB=N and TWIN_VOCAB=M make two drafters of one
# regeneration, which compare serves side by side. SHIPPED_FROM=SUMMARY: the shipped drafter's rows from an earlier
# summary-compare.json on the same GPU kind. REGEN_BS, REGEN_GRAPHS: the regeneration's levers; REGEN_ONLY=1 trains
# on the target's own replies alone. Then, here: python -m benchmarks.release_drafter UNPACKED --sharegpt
# $DATA_DIR/sharegpt-7000.json.xz [--sharegpt $DATA_DIR/sharegpt-rest.json.xz] --out drafters/smollm2-135m-instruct.
set -uo pipefail
mkdir -p "$WORK"
DATA_DIR=${DATA_DIR:-$WORK/data}  # the embedded ShareGPT cut (benchmarks/sharegpt_cuts.py), EAGLE's sets beside it
[ -f "$DATA_DIR/sharegpt-7000.json.xz" ] || "$E3_PYTHON" -m benchmarks.sharegpt_cuts "$DATA_DIR" --benchsets "${BENCHSETS:-../shared/benchsets}" > /dev/null || exit 3
G=$WORK/carried; W=$WORK; mkdir -p "$OUT" "$WORK" $W
SHAREGPT=$DATA_DIR/sharegpt-7000.json.xz
# MORE as `train` ran it, for the calls after it (wait, bring: the splits it draws again are that run's)
MORE=${MORE:-$(cat $W/more 2> /dev/null || echo 0)}
SOURCES=$SHAREGPT; [ "$MORE" = 1 ] && SOURCES="$SHAREGPT,$DATA_DIR/sharegpt-rest.json.xz"  # peers.sh stage5's
ours_env() {
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
}
RUN=$W/release-smollm2
shipped_status() {  # N: what `shipped` has done so far, its log's last N lines
  [ -f $W/shipped.log ] || return 0
  echo "shipped: $(cat $W/shipped.done 2>/dev/null || echo running)"; tail -n "$1" $W/shipped.log
}
in_parts() {  # a file over 16 MiB does not come back from the device: FILE.part-aa, -ab, ... in its place
  [ "$(stat -c %s "$1")" -gt 15000000 ] || return 0
  split -b 15000000 "$1" "$1.part-" && rm "$1"
}
compared() {  # served AL at depth 3, 30 prompts of each of seven sets: the same prompts for every drafter
  timeout -k 20 "${BUDGET_S:-540}" "$E3_PYTHON" -m benchmarks.questions.served_al $RUN --params params/smollm2-135m-gpu-release.yaml \
    --depths "${DEPTHS:-3}" --per-set "${PER_SET:-30}" --no-offline --parallel "${PARALLEL:-2}" --mem-fraction 0.12 \
    --sets "held_out,mt_bench,humaneval,$DATA_DIR/gsm8k.jsonl,$DATA_DIR/alpaca.jsonl,$DATA_DIR/sum.jsonl,$DATA_DIR/qa.jsonl" \
    --engine-flag=--disable-cuda-graph "$@"
}

case "${1:-}" in
  train)
    ours_env
    "$E3_PYTHON" -c "
import yaml
import os
p = yaml.safe_load(open('params/smollm2-135m-cpu.yaml'))
p['data']['sources'] = ['$SHAREGPT']
# its paths are relative to params/, and this copy lives in $W: the released drafter it starts from, by full path
p['train']['init_from'] = os.path.abspath(os.path.join('params', p['train']['init_from']))
yaml.safe_dump(p, open('$W/tiny-unseen.yaml', 'w'))" || exit 3
    rm -f $W/train.done $W/twin.done; echo "$MORE" > $W/more
    # an earlier run's 00_prepare (its `bring-prepared`), carried as $G/release-prepared: the run skips the
    # regeneration where params and notebook are the same (the stage's hash), and prepares afresh otherwise
    if ls $G/release-prepared/release-prepared.tgz* > /dev/null 2>&1; then
      cat $G/release-prepared/release-prepared.tgz* | tar -C $W -xzf - && echo "train: 00_prepare restored" || exit 3
    fi
    # MORE=1: every embedded conversation less smollm2-135m-cpu.yaml's val and bench, as many of their
    # replies regenerated as REGEN_MIN minutes allow (a carried 00_prepare's value, else it prepares afresh),
    # TRAIN_MIN minutes of training; params/smollm2-135m-gpu-release.yaml takes these values
    # in the commit that ships the drafter they make (its provenance test draws the shipped splits again)
    MORE_SET=""; [ "${MORE:-0}" = 1 ] && MORE_SET="--set data.max_conversations=100000 \
      --set data.regenerate.budget_tokens=4000000 --set data.regenerate.max_minutes=${REGEN_MIN:-2} \
      --set train.max_minutes=${TRAIN_MIN:-7}"
    # online (ONLINE=1, MORE's default): the states captured beside the trainer, never written. On the H100 the
    # extraction of 12.9 M tokens as fp8 shards took 226 s (0.22x the plain forward: 30 GB written), and on the
    # H200 online training ran at 1.7-1.8x the tokens/s of training from shards (benchmarks/results/online/h200-2026-12-03/)
    # shards (ONLINE=0): fp8, ~10 M tokens at 4.6 KB a token in bf16 would be 46 of the machine's 64 GB free
    if [ "${MORE:-0}" = 1 ] && [ "${ONLINE:-1}" = 1 ]; then MORE_SET="$MORE_SET --set train.source=online"
    elif [ "${MORE:-0}" = 1 ]; then MORE_SET="$MORE_SET --set extract.store_dtype=float8_e4m3fn"; fi
    # VOCAB=N: a draft vocabulary of N tokens (smollm2-135m-gpu-release.yaml's 2,048 covers 78% of the embedded replies'
    # tokens, 8,192 91%); params/smollm2-135m-cpu.yaml's fine-tune must then take the same
    [ -n "${VOCAB:-}" ] && MORE_SET="$MORE_SET --set train.draft_vocab_size=$VOCAB"
    # the regeneration's rate, its levers (their rates: benchmarks/results/regenerate/): REGEN_BS=N conversations in flight,
    # REGEN_GRAPHS=N SGLang's decode CUDA graphs up to batch N in place of --disable-cuda-graph (SGLang 0.5.17's
    # flag; prefill's graphs stay off: their default backends compile)
    [ -n "${REGEN_BS:-}" ] && MORE_SET="$MORE_SET --set data.regenerate.batch_size=$REGEN_BS"
    # REGEN_ONLY=1: train and val keep only the conversations the target answered itself
    [ "${REGEN_ONLY:-0}" = 1 ] && MORE_SET="$MORE_SET --set data.regenerate.only_regenerated=true"
    if [ -n "${REGEN_GRAPHS:-}" ]; then  # the params' flags, --disable-cuda-graph replaced (no spaces: one word)
      ARGS=$("$E3_PYTHON" -c "import json, sys, yaml
a = [f for f in yaml.safe_load(open('params/smollm2-135m-gpu-release.yaml'))['engine']['extra_args'] if f != '--disable-cuda-graph']
print(json.dumps(a + ['--cuda-graph-max-bs-decode', sys.argv[1], '--disable-prefill-cuda-graph'], separators=(',', ':')))" \
        "$REGEN_GRAPHS") || exit 3
      MORE_SET="$MORE_SET --set engine.extra_args=$ARGS"
    fi
    setsid -f bash -c '"$E3_PYTHON" -m benchmarks.peers measure "$1/train.json" -- "$E3_PYTHON" -m eagle3lib run \
        params/smollm2-135m-gpu-release.yaml --to "$4" --set run.output_root="$1" --set "data.sources=[$2]" \
        --set "data.keep_unseen=[$1/tiny-unseen.yaml]" $3 > "$1/train.log" 2>&1 < /dev/null; echo "rc $?" > "$1/train.done"' \
      _ "$W" "$SOURCES" "$MORE_SET" "${TO:-train}" > /dev/null 2>&1 < /dev/null  # nothing of the call's pipes held: the call returns
    # TWIN_VOCAB=N: a second training beside the first, on the same 00_prepare (linked once the first run's
    # extraction ended), with a draft vocabulary of N: one regeneration, two drafters, served side by side by
    # `compare` (the GPU waits on launches at this size: two trainings share it at little cost to each)
    if [ -n "${TWIN_VOCAB:-}" ]; then
      setsid -f bash -c 'until [ -f "$1/release-smollm2/01_extract/result.json" ] || [ -f "$1/train.done" ]; do sleep 10; done
        [ -f "$1/release-smollm2/01_extract/result.json" ] || { echo "rc 8 (the first run ended before its extraction)" > "$1/twin.done"; exit; }
        mkdir -p "$1/twin/release-smollm2" && for s in 00_prepare 01_extract; do ln -sfn "$1/release-smollm2/$s" "$1/twin/release-smollm2/$s"; done
        "$E3_PYTHON" -m benchmarks.peers measure "$1/twin.json" -- "$E3_PYTHON" -m eagle3lib run params/smollm2-135m-gpu-release.yaml \
          --only train --set run.output_root="$1/twin" --set "data.sources=[$2]" \
          --set "data.keep_unseen=[$1/tiny-unseen.yaml]" $3 --set train.draft_vocab_size="$4" > "$1/twin.log" 2>&1 < /dev/null
        echo "rc $?" > "$1/twin.done"' _ "$W" "$SOURCES" "$MORE_SET" "$TWIN_VOCAB" > /dev/null 2>&1 < /dev/null
    fi
    sleep 45; tail -n 5 $W/train.log; exit 0 ;;
  wait)
    t0=$(date +%s)
    until [ -f $W/train.done ] && { [ ! -d $W/twin ] || [ -f $W/twin.done ]; }; do
      [ $(( $(date +%s) - t0 )) -ge "${WAIT_S:-540}" ] && { echo "still running"; tail -n 5 $W/train.log
        shipped_status 4
        exit 9; }
      sleep 10
    done
    cat $W/train.done; tail -n 25 $W/train.log
    [ -f $W/twin.done ] && { echo "twin: $(cat $W/twin.done)"; tail -n 6 $W/twin.log; }
    shipped_status 8
    # the drafter comes back in the call that saw it made: a device taken back during a later call (serving) then
    # loses only the serving
    grep -q "rc 0" $W/train.done && [ -d $RUN/02_train/drafter ] && { bash "$0" bring || exit $?; }  # not after TO=prepare
    exit 0 ;;
  serve)
    ours_env
    timeout -k 20 "${BUDGET_S:-540}" "$E3_PYTHON" -m benchmarks.questions.served_al $RUN --params params/smollm2-135m-gpu-release.yaml \
      --drafter release=$RUN/02_train/drafter --depths "${DEPTHS:-1,2,3,5}" --sets "held_out,mt_bench,humaneval,$DATA_DIR/gsm8k.jsonl" \
      --per-set "${PER_SET:-10}" --parallel "${PARALLEL:-4}" --mem-fraction 0.12 --engine-flag=--disable-cuda-graph \
      --work $W/served --out "$OUT/summary.json" > "$OUT/serve.log" 2>&1; rc=$?; tail -n 25 "$OUT/serve.log"
    cp "$OUT/summary.json" $W/ 2>/dev/null; exit $rc ;;  # for bring, in this call or the next ($OUT is each call's)
  compare)
    # the drafter made here against the one the checkout ships (drafters/), on the same prompts at depth 3: the
    # four sets and EAGLE's alpaca, sum and qa, which neither trained on (the held-out set is this run's bench, which
    # the shipped drafter may have trained on: it saw 5,816 of the first 6,000 conversations)
    ours_env
    DRAFTERS=(--drafter release=$RUN/02_train/drafter)
    # SHIPPED_FROM=SUMMARY: the shipped drafter's rows from an earlier run's summary on the same GPU kind, not
    # served again (on the H100 they were the same to the last digit, prompt by prompt, in three runs)
    if [ -n "${SHIPPED_FROM:-}" ]; then
      "$E3_PYTHON" -c "
import json, sys
d = json.load(open(sys.argv[1]))
d['rows'] = [r for r in d['rows'] if r['trainer'] == 'shipped' and r['set'] != 'val']
d['means'] = [m for m in d['means'] if m['trainer'] == 'shipped']
assert d['rows'], 'no served rows of the shipped drafter in ' + sys.argv[1]
json.dump(d, open(sys.argv[2], 'w'))" "$SHIPPED_FROM" $W/summary-shipped.json && echo "rc 0 (from $SHIPPED_FROM)" > $W/shipped.done \
        || exit 3
    fi
    SHIPPED_ROWS=0; if [ -f $W/shipped.done ] && grep -q "rc 0" $W/shipped.done; then SHIPPED_ROWS=1  # `shipped`'s
    else DRAFTERS+=(--drafter shipped=drafters/smollm2-135m-instruct --base shipped:defaults); fi
    # the twin (TWIN_VOCAB): served beside, twice the servers at once, so that the call's time holds both
    [ -d $W/twin/release-smollm2/02_train/drafter ] && DRAFTERS+=(--drafter twin=$W/twin/release-smollm2/02_train/drafter) \
      && export PARALLEL=${PARALLEL:-4}
    compared "${DRAFTERS[@]}" --work $W/compared --out "$OUT/summary-compare.json" > "$OUT/compare.log" 2>&1
    rc=$?; tail -n 25 "$OUT/compare.log"; cp "$OUT/summary-compare.json" $W/ 2>/dev/null  # for bring
    if [ $SHIPPED_ROWS = 1 ] && [ $rc = 0 ]; then
      cp $W/summary-shipped.json "$OUT/" && "$E3_PYTHON" -m benchmarks.al_interval "$OUT/summary-compare.json" \
        "$OUT/summary-shipped.json" --base shipped:defaults | tee "$OUT/compare-ratio.txt"; cp "$OUT/compare-ratio.txt" $W/
    fi
    exit $rc ;;
  shipped)
    # in its own session, so that it outlives the call; it waits for train's 00_prepare (the held-out prompts)
    [ -n "${SHIPPED_FROM:-}" ] && { echo "shipped: its rows come from $SHIPPED_FROM (compare)"; exit 0; }
    rm -f $W/shipped.done
    setsid -f bash -c 'until [ -f "$1/00_prepare/result.json" ] || [ -f "$2/train.done" ]; do sleep 10; done
      bash "$3" shipped-now > "$2/shipped.log" 2>&1 < /dev/null; echo "rc $?" > "$2/shipped.done"' \
      _ "$RUN" "$W" "$0" > /dev/null 2>&1 < /dev/null
    echo "shipped: waiting for $RUN/00_prepare/result.json"; exit 0 ;;
  shipped-now)
    ours_env
    [ -f $RUN/00_prepare/result.json ] || { echo "no 00_prepare in $RUN"; exit 3; }
    compared --drafter shipped=drafters/smollm2-135m-instruct --work $W/compared-shipped --out $W/summary-shipped.json ;;
  bring-prepared)
    # the regenerated conversations (00_prepare, after `TO=prepare train` and `wait`), for a later run's train:
    # there, carry them as $G/release-prepared (cat release-prepared.tgz.part-* > release-prepared.tgz is not needed)
    grep -q "rc 0" $W/train.done || { echo "00_prepare has not ended well: $(cat $W/train.done 2>/dev/null)"; exit 3; }
    tar -C $W -czf "$OUT/release-prepared.tgz" release-smollm2/00_prepare || exit 4
    in_parts "$OUT/release-prepared.tgz" || exit 5
    cp $RUN/00_prepare/result.json "$OUT/00_prepare_result.json"; ls -la "$OUT"; exit 0 ;;
  bring)
    ours_env
    # the ids of each split, as 00_prepare drew them (load_pool, split_conversations): the disjointness check here
    # draws them again from the embedded data and compares
    "$E3_PYTHON" -c "
import json
from eagle3lib.params import load_params
from eagle3lib.prepare import conversations, notebook
more = {'data.max_conversations': 100000} if '${MORE:-0}' == '1' else {}  # as train's MORE_SET
p = load_params('params/smollm2-135m-gpu-release.yaml', {'data.sources': '$SOURCES'.split(','), 'data.keep_unseen': ['$W/tiny-unseen.yaml']} | more)
pool, stats = notebook.load_pool(p)
splits = conversations.split_conversations(pool, p.data.val_fraction, p.data.bench_count, p.run.seed)
json.dump({k: [c['id'] for c in v] for k, v in splits.items()} | {'kept_unseen': list(stats['kept_unseen'].values())},
          open('$W/conversation_ids.json', 'w'))
print({k: len(v) for k, v in splits.items()}, stats['kept_unseen'])" || exit 3
    # each drafter's weights in bf16, as release_drafter.py stores them (half the bytes: a call brings back 64 MiB,
    # and the twin's larger vocabulary with them); its sha256.json stays behind, release_drafter.py hashes anew
    "$E3_PYTHON" -c "
import pathlib, shutil
from safetensors.torch import load_file, save_file
for run in ('release-smollm2', 'twin/release-smollm2'):
    src, dst = pathlib.Path('$W', run, '02_train/drafter'), pathlib.Path('$W/pack', run, '02_train/drafter')
    if not src.is_dir():
        continue
    shutil.rmtree(dst, ignore_errors=True); dst.mkdir(parents=True)
    for name in ('config.json', 'eagle3.json'):
        shutil.copy(src / name, dst / name)
    tensors = load_file(str(src / 'model.safetensors'))
    save_file({k: v.bfloat16() if v.is_floating_point() else v for k, v in tensors.items()}, str(dst / 'model.safetensors'))
" || exit 4
    tar -czf "$OUT/release.tgz" -C $W/pack $(cd $W/pack && ls -d release-smollm2 twin 2>/dev/null) -C $W release-smollm2/run.json \
      --exclude='*.ipynb' release-smollm2/00_prepare/result.json release-smollm2/01_extract/result.json \
      release-smollm2/02_train/result.json train.json train.log conversation_ids.json tiny-unseen.yaml \
      $(cd $W && ls summary.json summary-compare.json summary-shipped.json compare-ratio.txt shipped.log 2>/dev/null) \
      $(cd $W && ls -d twin/release-smollm2/02_train/result.json twin.json twin.log 2>/dev/null) || exit 4
    # a larger draft vocabulary's archive goes in parts (here: cat release.tgz.part-* > release.tgz)
    in_parts "$OUT/release.tgz" || exit 5
    ls -la "$OUT"; exit 0 ;;
  *) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2 ;;
esac
