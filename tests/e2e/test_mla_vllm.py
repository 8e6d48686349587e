"""Our MLA draft layer is the one vLLM serves: vLLM's own Eagle3DeepseekV2ForCausalLM (deepseek_eagle3.py), loaded by
its own loader from our canonical checkpoint folder, computes Drafter.step's state and logits on the same inputs."""

import pytest
import torch
from conftest import need_engine
from safetensors.torch import load_file, save_file

from eagle3lib.drafter import DraftCache, Drafter, DrafterConfig
from eagle3lib.drafter.mla import MLA_ARCHITECTURE
from eagle3lib.drafter.vocab import build_draft_vocab
from eagle3lib.engines.interpreter import run_engine_side
from eagle3lib.train.runtime.checkpoint import save_drafter

AUX = [2, 15, 27]
DRAFT_VOCAB = 256
# kv_lora_rank + qk_rope_head_dim = 576: the only latent width vLLM's CPU MLA backend builds; v_head_dim (48) differs
# from the qk head dim (32 + 64), as Kimi's 128 against 192
MLA = {"q_lora_rank": 48, "kv_lora_rank": 512, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 48}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 4.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 2048,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}


def mla_drafter(target_config, variants: dict) -> Drafter:
    """A small MLA drafter (hidden 64, 4 heads) for the embedded target's vocabulary and aux states, random weights with
    norms near 1 (as trained ones are), YaRN rope (Kimi's kind), a draft vocabulary mapped through d2t."""
    cfg = DrafterConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=MLA["qk_rope_head_dim"],
        intermediate_size=128,
        vocab_size=target_config.vocab_size,
        draft_vocab_size=DRAFT_VOCAB,
        target_hidden_size=target_config.hidden_size,
        aux_layer_ids=AUX,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        rope_parameters=dict(YARN),
        draft_attention="mla",
        **{**MLA, **variants},
    )
    torch.manual_seed(0)
    drafter = Drafter(cfg).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.05)
    drafter.set_vocab(*build_draft_vocab(torch.randint(0, 1000, (target_config.vocab_size,)), DRAFT_VOCAB))
    return drafter


@pytest.mark.slow
@pytest.mark.parametrize(
    "variants",
    [{}, {"fc_norm": True, "norm_output": True, "norm_before_residual": True}],
    ids=["eagle3", "eagle31-norms"],
)
def test_vllm_mla_forward_equals_our_drafter_step(embedded_cache, embedded_target, tmp_path, variants):
    """vLLM's Eagle3DeepseekV2ForCausalLM, loaded from our checkpoint folder (config.json and tensors as Drafter holds
    them: TorchSpec's keys, layers.0.self_attn.q_a_proj etc., which vLLM fuses itself), against Drafter.step on the same
    9 positions (1000..1008: past YaRN's original context, so its frequencies and mscale² count) of the target's
    embeddings and random aux states: same state for the next step, same logits over the target's vocabulary. The
    attention kernel is a plain causal softmax over vLLM's own q, latent and kv_b_proj (engines/engine_side/load_check.py).
    Also with the EAGLE-3.1 norms vLLM's MLA drafter implements (fc_norm, norm_output, norm_before_residual)."""
    py = need_engine("vllm")
    model = embedded_target[0]
    drafter = mla_drafter(model.config, variants)
    folder = save_drafter(drafter, tmp_path / "drafter", contract={})  # vLLM reads config.json and the tensors
    torch.manual_seed(1)
    embeds = torch.randn(9, 64)
    aux = torch.randn(9, 3 * model.config.hidden_size)
    positions = torch.arange(1000, 1009)
    inputs, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file({"input_embeds": embeds.contiguous(), "aux": aux, "positions": positions}, str(inputs))
    report = run_engine_side(
        "load_check.py",
        ["vllm-forward", str(folder), "--target", str(embedded_cache[1]), "--inputs", str(inputs), "--out", str(out)],
        py,
    )
    assert report["ok"] and report["model_class"] == MLA_ARCHITECTURE, report
    theirs = load_file(str(out))
    with torch.no_grad():
        hidden, logits = drafter.step(DraftCache(), embeds[None], aux[None], positions[None], from_target=True)
    ours = torch.full((9, model.config.vocab_size), float("-inf"))
    ours[:, drafter.draft_to_target(torch.arange(DRAFT_VOCAB))] = logits[0]
    assert torch.equal(torch.isfinite(theirs["logits"]), torch.isfinite(ours))  # the same draft vocabulary
    finite = torch.isfinite(ours)
    scale = ours[finite].abs().max()
    assert (theirs["logits"][finite] - ours[finite]).abs().max() <= 1e-4 * scale
    assert (theirs["prenorm"] - hidden[0]).abs().max() <= 1e-4 * hidden.abs().max()
    assert torch.equal(theirs["logits"].argmax(-1), ours.argmax(-1))


@pytest.mark.slow
def test_vllm_does_not_load_an_mla_draft_without_the_low_rank_q(embedded_cache, embedded_target, tmp_path):
    """Why train.mla needs a q_lora_rank (DrafterConfig.with_mla): vLLM 0.32's loader stacks kv_a_proj_with_mqa into
    fused_qkv_a_proj, which its MLA attention has only with q_lora_rank, so a q_proj drafter does not load (and SGLang
    0.5.17's kimi_k25_eagle3 raises without q_lora_rank). If a vLLM release loads it, this fails: lift the refusal."""
    py = need_engine("vllm")
    folder = save_drafter(mla_drafter(embedded_target[0].config, {"q_lora_rank": None}), tmp_path / "d", contract={})
    report = run_engine_side("load_check.py", ["vllm", str(folder), "--target", str(embedded_cache[1])], py)
    assert not report["ok"] and any("fused_qkv_a_proj" in p for p in report["problems"]), report
