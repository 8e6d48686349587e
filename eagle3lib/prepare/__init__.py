"""Stage 00 prepare: conversations, splits, tokens and loss masks, regenerated replies."""
