"""SGLang serving a tiny random-weight Kimi-K2.5 copy with our EAGLE-3 export: does it launch, bind and verify drafts.

A tiny random-weight copy of Kimi-K2.5 (DeepseekV3ForCausalLM: MLA with Kimi's 512 + 64 latent, 8 MoE experts,
YaRN; eagle3lib/target/tiny.py) served by SGLang with the SGLang export of a finished
params/kimi-k2.5-tiny-cpu.yaml run, token ids in and out, without and with speculation (depth 3) on the same
prompts. Random weights: the check is that the launch works, the drafter binds and the engine verifies drafts
(spec_verify_ct), not the acceptance. On a GPU host:

    python -m benchmarks kimi_tiny_sglang gpu-plan prep RUN_DIR [TARGET_WEIGHTS]   # config, tokenizer, export
    python -m benchmarks kimi_tiny_sglang gpu-plan serve                          # base and spec servers

Prints one JSON line per mode (output ids, verify steps, acceptance) and whether the two modes' ids agree.
"""

from __future__ import annotations

import sys

from benchmarks.gpu_script import PlanQuestion

PLANS = {"prep": (["prep"], {}), "serve": (["serve"], {})}


main, dry_run = PlanQuestion("kimi_tiny_sglang", PLANS, "serve").entry_points()


if __name__ == "__main__":
    sys.exit(main())
