"""Stage 02 train: the EAGLE-3 drafter trained with training-time test."""


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite loss, bad inputs); the message says what to change."""
