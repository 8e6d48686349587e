"""Training and online placements across several GPUs of one host: not measured yet (the plan exists, no figures).

On a host of N GPUs: our training step at 8,192 on packed rows on one GPU, then under torchrun on N (each rank its
own rows, the gradients all-reduced): tokens/s, the scaling efficiency against N x one GPU and whether every rank
ends with the same weights; then SGLang's in-process capture of Llama-3.1-8B's shape (dummy weights) on one GPU and
tensor parallel over N, each against the same engine's plain prefill (capture.sh MODE=tp). Not here: the TP
capture's agreement with the 1-GPU one (dummy weights differ under TP) and SGLang serving at --tp N.

    python -m benchmarks multi_gpu gpu-plan [N]    # N: the GPUs to use (default 4)

Prints one JSON line of the training's scaling and the capture's rows.
"""

from __future__ import annotations

import sys

from benchmarks.gpu_script import PlanQuestion

PLANS = {str(n): ([], {"N": str(n)}) for n in (2, 4, 8)}


main, dry_run = PlanQuestion("multi_gpu", PLANS, "4").entry_points()


if __name__ == "__main__":
    sys.exit(main())
