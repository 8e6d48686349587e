"""The drafter's TTT on a GPU where the CPU tests cannot reach: EAGLE-3.1's norms under bf16 autocast (the fused
causal kernels take fp16/bf16 only) and an MLA drafter's 192-wide heads in fp32 (flex_attention, as our validation
and the predicted AL run it), forward and backward, on rows of 2,048 holding three documents. Each case's loss is finite.

    .venv/bin/python -m pytest tests/gpu/test_drafter_dtypes.py
"""

import math
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig

from eagle3lib.drafter.model import Drafter, DrafterConfig

SMOLLM2 = LlamaConfig(  # the embedded target's shape
    hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
    vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
)  # fmt: skip
MLA_DIMS = dict(q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
ROW, STEPS, DOCUMENT = 2048, 5, 700
pytestmark = pytest.mark.gpu


def ttt_loss(cfg: DrafterConfig, autocast: bool, grad: bool) -> float:
    drafter = Drafter(cfg).cuda()
    aux = torch.randn(1, ROW, 3 * SMOLLM2.hidden_size, device="cuda")
    embeds = torch.randn(1, ROW + STEPS - 1, SMOLLM2.hidden_size, device="cuda")
    positions = torch.arange(ROW, device="cuda")[None]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast), torch.set_grad_enabled(grad):
        hidden = drafter.ttt_forward(aux, embeds, positions % DOCUMENT, positions // DOCUMENT)
        loss = sum(drafter.logits(h).float().logsumexp(-1).mean() for h in hidden)
        if grad:
            loss.backward()
    torch.cuda.synchronize()
    return loss.item()


GQA = DrafterConfig.from_target(SMOLLM2, 16384, [2, 15, 27])
MLA = DrafterConfig.from_target(SMOLLM2, 16384, [2, 15, 27], "mla", MLA_DIMS)
CASES = {
    "gqa norm_before_fc+norm_output bf16 train": (replace(GQA, norm_before_fc=True, norm_output=True), True, True),
    "mla bf16 train": (MLA, True, True),
    "mla fp32 eval (flex)": (MLA, False, False),
    "mla fp32 train (flex)": (MLA, False, True),
}


@pytest.mark.parametrize("name", CASES)
def test_the_ttt_runs_forward_and_backward_on_a_gpu(name):
    cfg, autocast, grad = CASES[name]
    loss = ttt_loss(cfg, autocast, grad)
    assert math.isfinite(loss) and loss > 0
