"""Stage 01 extract: the target's hidden states captured into checksummed, resumable shards."""
