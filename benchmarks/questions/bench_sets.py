"""A drafter served by SGLang on EAGLE's six question sets: 05_benchmark of a finished run's drafter on a GPU.

A finished CPU run's drafter (params/smollm2-135m-cpu.yaml: its bench split, 02_train and 03_convert), served with
params/smollm2-135m-gpu.yaml's engine: 05_benchmark on held_out, mt_bench and humaneval and on EAGLE's gsm8k,
alpaca, sum and qa (question.jsonl files from --benchsets). On a GPU host:

    python -m benchmarks bench_sets gpu-plan prep RUN_DIR [BENCHSETS_DIR]   # the run and the sets into WORK
    python -m benchmarks bench_sets gpu-plan bench                         # 05_benchmark on every set

Prints the stage's headline and each set's AL, speedup and predicted AL per depth.
"""

from __future__ import annotations

import sys

from benchmarks.gpu_script import PlanQuestion

PLANS = {"prep": (["prep"], {}), "bench": (["bench"], {})}


main, dry_run = PlanQuestion("bench_sets", PLANS, "bench").entry_points()


if __name__ == "__main__":
    sys.exit(main())
