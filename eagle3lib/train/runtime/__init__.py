"""The machinery around 02_train's loop (train/loop.py): what a run trains on (setup.py), the input pipeline
(batches.py), checkpoints and resume (checkpoint.py, best_kept.py), the optimizer and the learning-rate schedule
(optimizer.py, schedule.py), data parallel over torchrun (distributed.py), the torch.compile and FP8 speedups
(speedups.py), starting from an existing drafter (warm_start.py), and the stage's processes (launch.py)."""
