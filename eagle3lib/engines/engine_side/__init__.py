"""Code that runs in an engine's own interpreter: the standard library, torch, safetensors and that engine only."""
