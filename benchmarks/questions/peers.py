"""Our drafter against speculators' and SpecForge's from the same data, served by one engine (served and offline AL).

The embedded target's ShareGPT conversations regenerated through SGLang, one extraction (hf, bf16) whose train/val
split feeds all three trainers (benchmarks/peer_data.py writes each peer's format; benchmarks/peers.py drives their
CLIs), each for the same epochs with its own defaults, then every drafter served by SGLang at depths 3 and 5
(served_al). Runs on a GPU host in the setup script's environments (peers.sh's steps, in order):

    python -m benchmarks peers gpu-plan data            # prepare + extract, then the peers' data formats
    python -m benchmarks peers gpu-plan launch          # every trainer x configuration in the background
    python -m benchmarks peers gpu-plan wait            # their records into the result folder's raw/
    python -m benchmarks peers gpu-plan serve           # served AL of every trained drafter (summary.json)
    python -m benchmarks peers gpu-plan ours CONFIG     # one trainer, one configuration (also specforge, speculators)

Prints the script's lines; the serving step's summary is served_al's.
"""

from __future__ import annotations

import sys

from benchmarks.gpu_script import PlanQuestion

STEPS = ("data", "launch", "wait", "ours", "specforge", "speculators", "offline", "pick", "serve", "bring", "restore")
PLANS = {step: ([step], {}) for step in STEPS}


main, dry_run = PlanQuestion("peers", PLANS, "serve", dry_plan="data").entry_points()


if __name__ == "__main__":
    sys.exit(main())
