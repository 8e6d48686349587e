"""Stage 03 convert: one canonical checkpoint to each engine's layout, and the load-back gate."""
