"""Stage 02 train: the EAGLE-3 drafter trained with training-time test."""
