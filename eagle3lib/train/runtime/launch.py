"""02_train's entry point: the stage as its placement lays it out (sources.for_params: one process, torchrun, a
capture process, Ray actors, or SGLang's interpreter), and each of its processes.

    summary = launch(p, run_dir)                      # the 02_train notebook and `python -m eagle3lib run`
    python -m eagle3lib.train.runtime.launch PARAMS RUN_DIR [OVERRIDES_JSON]   # a process the placement starts
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from eagle3lib.train import sources
from eagle3lib.train.loop import train
from eagle3lib.train.runtime.distributed import default_group, init_process_group, rank_and_world, trainers_joined
from eagle3lib.train.runtime.setup import setup_for
from eagle3lib.train.sources.base import SUMMARY

# The deepest chain the validation's estimated acceptance length is reported for (the user's first ask). A fixed
# depth, not bench.depths: 02_train's hash does not cover the bench section, and 05_benchmark extends its own
# predictions from cond_acc to any depth.
EVAL_MAX_DEPTH = 16


def launch(p, run_dir) -> dict:
    """Run the stage (its placement starts its processes); returns the first trainer's summary."""
    return sources.for_params(p).launch(sources.StageRun(p, Path(run_dir), run_stage))


def run_stage(p, run_dir, handed=None) -> dict:
    """One process of the stage: build and train in it (rank-aware under torchrun); writes train_summary.json on
    the first trainer. handed: what this process's launcher gave it (the Ray capture actor of a trainer actor), or
    a capture already loaded to train online through (a caller that keeps it open)."""
    placement = sources.for_params(p)
    device = init_process_group(p.target.device)
    proc = sources.StageProcess(p, Path(run_dir), device, handed)
    placement.check_started(proc)
    if placement.serves_capture(proc):
        return {}
    rank, world = rank_and_world()
    setup, vocab_stats = setup_for(proc, placement)
    try:
        summary = train(
            setup,
            p.train,
            p.run.seed,
            device,
            max_depth=EVAL_MAX_DEPTH,
            log=(print if rank == 0 else (lambda *a: None)),
        )
    finally:
        setup.source.close()
    summary.update(
        vocab=vocab_stats,
        world_size=world,
        default_group=default_group(),  # the trainers' own (torchrun's): a capture process is never in it
        drafter_params=sum(x.numel() for x in setup.drafter.parameters()),
        # with the source, what a later run's online plan looks this run's training rate up by (train/notebook.py)
        target_fingerprint=setup.contract["target_fingerprint"],
        source=p.train.source,
    )
    if rank == 0:
        (setup.out_dir / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    if trainers_joined():  # the trainers (a capture process talks to them over a link of its own)
        dist.barrier()
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    from eagle3lib.params import load_params, stage_view

    # a process of this stage sees 02_train's view of the params: a section its hash does not cover raises
    overrides = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    run_stage(stage_view(load_params(sys.argv[1], overrides), "02_train"), sys.argv[2])
