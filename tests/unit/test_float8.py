"""train.float8: torchao's FP8 training recipe on the drafter's projections, emulated on the CPU."""

import copy
import sys
from pathlib import Path

import pytest
import torch

from eagle3lib.drafter import Drafter, DrafterConfig
from eagle3lib.train.runtime.speedups import convert_to_float8
from eagle3lib.train.ttt_step import ttt_loss_sums

# `make test` installs torchao into .fp8-site, outside the workbook's environment (pyproject's fp8 extra says why).
FP8_SITE = Path(__file__).resolve().parents[2] / ".fp8-site"
if FP8_SITE.is_dir() and str(FP8_SITE) not in sys.path:
    sys.path.append(str(FP8_SITE))
pytest.importorskip("torchao.float8", reason="train.float8 needs torchao: `make fp8-site` (or pip install '.[fp8]')")


def small_drafter():
    torch.manual_seed(0)
    cfg = DrafterConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=256,
        draft_vocab_size=64,
        target_hidden_size=48,
        aux_layer_ids=[1, 2, 3],
    )
    drafter = Drafter(cfg)
    d2t = torch.arange(64) * 3
    t2d = torch.zeros(256, dtype=torch.bool)
    t2d[torch.arange(64) * 4] = True
    drafter.set_vocab(d2t, t2d)
    return drafter


def loss_and_grads(drafter, batch, embed, head):
    drafter.zero_grad()
    sums, counts, _, _ = ttt_loss_sums(drafter, batch, embed, head, 3, with_metrics=False)
    loss = (sums / counts.clamp(min=1)).sum()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def test_float8_converts_the_projections_and_trains_close_to_full_precision():
    bf = small_drafter()
    f8 = copy.deepcopy(bf)
    names = convert_to_float8(f8, emulate=True)
    assert sorted(names) == [
        "fc",
        "layers.0.mlp.down_proj",
        "layers.0.mlp.gate_proj",
        "layers.0.mlp.up_proj",
        "layers.0.self_attn.o_proj",
    ]
    assert set(f8.state_dict()) == set(bf.state_dict())  # checkpoints keep their names
    g = torch.Generator().manual_seed(1)
    t = 96
    batch = {
        "input_ids": torch.randint(0, 256, (1, t), generator=g),
        "loss_mask": torch.ones(1, t, dtype=torch.long),
        "doc_ids": torch.zeros(1, t, dtype=torch.long),
        "position_ids": torch.arange(t)[None],
        "aux": torch.randn(1, t, 144, generator=g),
        "final": torch.randn(1, t, 48, generator=g),
    }
    embed, head = torch.randn(256, 64, generator=g), torch.randn(256, 48, generator=g)
    loss_bf, grads_bf = loss_and_grads(bf, batch, embed, head)
    loss_f8, grads_f8 = loss_and_grads(f8, batch, embed, head)
    assert abs(loss_f8 - loss_bf) <= 0.02 * abs(loss_bf)
    for name in ("fc.weight", "layers.0.mlp.down_proj.weight", "layers.0.self_attn.q_proj.weight"):
        cos = torch.nn.functional.cosine_similarity(grads_bf[name].flatten(), grads_f8[name].flatten(), 0)
        assert 0.97 <= cos < 1.0, (name, cos)  # FP8-rounded, not the same maths untouched


def test_float8_without_fp8_hardware_says_so():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this machine has FP8 matmuls")
    with pytest.raises(RuntimeError, match="compute capability"):
        convert_to_float8(small_drafter())
