"""Stage 02 train: the EAGLE-3 drafter trained with training-time test.

The core, read first: loop.py (the spine), ttt_step.py, loss.py, metrics.py. The machinery: runtime/ (setup,
batches, checkpoints, optimizer, schedule, data parallel, speedups, launch) and sources/ (where the states come
from: 01_extract's shards, or the target run alongside, online). notebook.py: the 02_train notebook's figures."""


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite loss, bad inputs); the message says what to change."""
