"""Where a speculative and a plain greedy run of one engine part ways, which of the two tokens the target in fp32
picks and by how much: a near-tie that bf16 rounds either way, or a drafter that changed the output.

    python benchmarks/greedy_ties.py TARGET_DIR PROMPTS.json BASE.json SPEC.json

PROMPTS.json: the prompts' token ids ([[ids], ...]); BASE.json and SPEC.json: kimi_tiny_sglang.sh's outputs
([{ids}, ...] in the same order).
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM


def main(target_dir, prompts_file, base_file, spec_file):
    prompts, base, spec = (json.load(open(f)) for f in (prompts_file, base_file, spec_file))
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for i, (b, s) in enumerate(zip(base, spec)):
        k = next((k for k, (x, y) in enumerate(zip(b["ids"], s["ids"])) if x != y), None)
        if k is None:
            print(f"prompt {i}: the same {len(b['ids'])} tokens")
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompts[i] + b["ids"][:k]])).logits[0, -1]
        x, y, top = b["ids"][k], s["ids"][k], int(logits.argmax())
        picks = "speculation's" if top == y else "the plain run's" if top == x else f"neither ({top})"
        print(
            f"prompt {i}: apart at token {k}: plain {x} ({logits[x]:.5f}), speculative {y} ({logits[y]:.5f}); "
            f"fp32 picks {picks}, margin {abs(logits[x] - logits[y]):.5f} (logits' std {logits.std():.3f})"
        )


if __name__ == "__main__":
    main(*sys.argv[1:5])
