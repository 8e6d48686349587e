"""Stage 05 benchmark: the depth sweep against no speculation, and the replay of speculative decoding."""
