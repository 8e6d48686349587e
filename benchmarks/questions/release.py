"""The released drafter for the embedded target: trained on a GPU, served for its provenance, brought back.

params/smollm2-135m-gpu-release.yaml trained on the embedded ShareGPT data less the default run's val and bench
conversations, served by SGLang at depths 1-5 (served AL per set) and compared at depth 3 against the drafter the
checkout ships; then, here, benchmarks/release_drafter.py writes drafters/<name>/ with provenance.json. Steps of
release.sh, in order, on a GPU host in the setup script's environments:

    python -m benchmarks release gpu-plan train      # regeneration, extraction, training, in the background
    python -m benchmarks release gpu-plan wait       # until it ends; then the drafter and its records (release.tgz)
    python -m benchmarks release gpu-plan serve      # served and predicted AL per set (summary.json)
    python -m benchmarks release gpu-plan compare    # depth 3 against the shipped drafter, seven sets
    python -m benchmarks.release_drafter UNPACKED --sharegpt ... --out drafters/smollm2-135m-instruct   # here

Prints the script's lines and served_al's tables.
"""

from __future__ import annotations

import sys

from benchmarks.gpu_script import PlanQuestion

STEPS = ("train", "wait", "serve", "compare", "shipped", "bring", "bring-prepared")
PLANS = {step: ([step], {}) for step in STEPS}


main, dry_run = PlanQuestion("release", PLANS, "train").entry_points()


if __name__ == "__main__":
    sys.exit(main())
