"""The MLA draft layer (drafter/mla.py, train.draft_attention: mla): its TTT forward is the chain an engine runs,
it is DeepSeek's attention as transformers computes it (YaRN, softmax scale), it trains, its config is TorchSpec's,
and the params refuse what cannot be built."""

import json
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig

from eagle3lib.drafter import DraftCache, Drafter, DrafterConfig
from eagle3lib.drafter.mla import MLA_ARCHITECTURE, MLAAttention
from eagle3lib.drafter.vocab import build_draft_vocab
from eagle3lib.params import load_params
from eagle3lib.target import WrapperConfig
from eagle3lib.train import TrainingError, ttt_step
from eagle3lib.train.runtime.batches import Sequence, make_batch
from eagle3lib.train.runtime.setup import init_layer_from_target, initial_drafter

TINY_PARAMS = Path(__file__).resolve().parents[2] / "params" / "smollm2-135m-cpu.yaml"
STEPS = 4
YARN = {
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 4.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
# v_head_dim (24) differs from the qk head dim (16 + 16): the TTT attention takes values of their own width
MLA = {"q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 24}


def deepseek_target(layers=3, vocab=300, hidden=64, dense_layers=None) -> DeepseekV3Config:
    """A tiny DeepSeek-V3 config (MLA, YaRN), its first dense_layers layers dense (default: all), the rest MoE."""
    return DeepseekV3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        first_k_dense_replace=layers if dense_layers is None else dense_layers,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        rms_norm_eps=1e-6,  # transformers' q_a/kv_a norms take 1e-6 whatever the config says; the engines its eps
        max_position_embeddings=256,
        rope_parameters=dict(YARN),
        tie_word_embeddings=False,
        **MLA,
    )


def mla_drafter(seed=0, q_lora_rank=24) -> Drafter:
    """q_lora_rank None: q_proj reads the input (DeepSeek-V2-Lite's layout, which no engine serves as a drafter)."""
    cfg = DrafterConfig.from_target(deepseek_target(), 100, [1, 2, 3], "mla")
    torch.manual_seed(seed)
    drafter = Drafter(DrafterConfig(**{**cfg.as_dict(), "target_hidden_size": 48, "q_lora_rank": q_lora_rank})).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # norms at ones would hide a misplaced one
    return drafter


def packed_rows():
    """Two rows: documents of 15 and 20 positions then 5 of padding; one document of 40."""
    torch.manual_seed(5)
    t = 40
    docs = torch.tensor([[0] * 15 + [1] * 20 + [-1] * 5, [0] * 40])
    pos = torch.stack(
        [torch.cat([torch.arange(15), torch.arange(20), torch.zeros(5, dtype=torch.long)]), torch.arange(t)]
    )
    return torch.randn(2, t, 144), torch.randn(2, t + STEPS - 1, 64), pos, docs


def chain_logits(drafter, aux, embeds, row, start, t):
    """Steps 0..STEPS-1 after position t of the document starting at `start` of `row`, one token at a time with a
    KV cache (Drafter.step), fed the same embeddings TTT is fed."""
    doc = slice(start, start + t + 1)
    cache = DraftCache()
    hidden, logits = drafter.step(
        cache, embeds[row : row + 1, doc], aux[row : row + 1, doc], torch.arange(t + 1)[None], from_target=True
    )
    out, hidden = [logits[0, -1]], hidden[:, -1:]
    for k in range(1, STEPS):
        fed = embeds[row : row + 1, start + t + k : start + t + k + 1]
        hidden, logits = drafter.step(cache, fed, hidden, torch.tensor([[t + k]]), from_target=False)
        out.append(logits[0, -1])
    return out


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q_lora", "q_proj"])
@pytest.mark.parametrize("attention", ["dense", "merged", "flex"])
def test_ttt_step_k_equals_the_cached_chain_on_packed_rows(attention, q_lora_rank):
    """Step k of ttt_forward at each position equals step k of the engine-style chain (Drafter.step, DraftCache) on
    that position's document alone, packed documents and padding included; with the low-rank q and with q_proj."""
    drafter = mla_drafter(q_lora_rank=q_lora_rank)
    assert hasattr(drafter.layer.self_attn, "q_proj" if q_lora_rank is None else "q_a_proj")
    aux, embeds, pos, docs = packed_rows()
    with torch.no_grad():
        hidden = drafter.ttt_forward(aux, embeds, pos, docs, attention=attention)
        worst = 0.0
        for row, start, t in [(0, 0, 3), (0, 0, 14), (0, 15, 0), (0, 15, 19), (1, 0, 39), (1, 0, 20)]:
            chain = chain_logits(drafter, aux, embeds, row, start, t)
            for k in range(STEPS):
                worst = max(worst, (drafter.logits(hidden[k])[row, start + t] - chain[k]).abs().max().item())
    assert worst <= 1e-4, f"{attention}: TTT and chain logits differ by {worst}"


def test_merged_gradients_equal_the_dense_ones_with_values_narrower_than_keys():
    """The merged path's own backward (the CPU reference of its fused kernels) with v_head_dim ≠ the qk head dim."""
    drafter = mla_drafter()
    aux, embeds, pos, docs = packed_rows()
    real = (docs >= 0)[..., None]
    grads = []
    for attention in ("dense", "merged"):
        drafter.zero_grad()
        outs = drafter.ttt_forward(aux, embeds, pos, docs, attention=attention)
        sum(((o * real) ** 2).sum() for o in outs).backward()
        grads.append({n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and "layers.0.self_attn.kv_b_proj.weight" in grads[0]
    for name, g in grads[0].items():
        assert (g - grads[1][name]).abs().max() <= 1e-4 * g.abs().max(), name


def kimi_head_case(packed: bool, device):
    """Kimi-K2.5's head dims (q/k 128 + 64, v 128) in a small drafter: rows of one document (one ending in padding) or
    packed rows whose documents cross 128-blocks."""
    heads = {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64, "kv_lora_rank": 64}
    heads.update(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    cfg = DrafterConfig(**{**mla_drafter().cfg.as_dict(), **heads})
    torch.manual_seed(3)
    t = 300 if packed else 150
    docs = torch.zeros(2, t, dtype=torch.long)
    pos = torch.arange(t).repeat(2, 1)
    if packed:
        for r, row in enumerate([[90, 170, 40], [260, 40]]):
            start = 0
            for d, n in enumerate(row):
                docs[r, start : start + n], pos[r, start : start + n] = d, torch.arange(n)
                start += n
        docs[1, 287:] = -1
    else:
        docs[1, 131:] = -1
    pos = pos * (docs >= 0)
    to = lambda x: x.to(device)  # noqa: E731
    return Drafter(cfg).to(device), to(torch.randn(2, t, 144)), to(torch.randn(2, t + 2, 64)), to(pos), to(docs)


def outputs_and_grads(drafter, aux, embeds, pos, docs, **kw):
    drafter.zero_grad()
    real = (docs >= 0)[..., None]
    outs = [o.float() * real for o in drafter.ttt_forward(aux, embeds, pos, docs, **kw)]
    sum((o**2).sum() for o in outs).backward()
    return outs, {n: p.grad.float().clone() for n, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN, flash attention and flex's backward run on CUDA")
@pytest.mark.parametrize("packed", [False, True], ids=["one-document-cudnn", "packed-flash-varlen"])
def test_the_gpu_kernels_take_mla_heads_as_the_dense_path_does(packed):
    """The merged path's fused kernels (cuDNN's causal kernel for rows of one document, flash attention's
    variable-length one for packed rows) in bf16 and flex_attention in fp32, with keys of 192 dims and values of 128
    (Kimi-K2.5's MLA heads after kv_b_proj), against the dense path in fp32: outputs and every gradient."""
    case = kimi_head_case(packed, "cuda")
    dense = outputs_and_grads(*case, attention="dense")

    def close(got, tol, what):
        for a, b in zip(dense[0], got[0]):
            assert (a - b).abs().max() <= tol * a.abs().max(), f"{what}: outputs"
        assert dense[1].keys() == got[1].keys()
        for name, g in dense[1].items():
            assert (g - got[1][name]).abs().max() <= tol * g.abs().max(), f"{what}: {name}"

    close(outputs_and_grads(*case, attention="flex"), 1e-2, "flex")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        close(outputs_and_grads(*case, attention="merged"), 5e-2, "merged")


def test_the_mla_layer_started_from_a_deepseek_layer_is_its_exact_early_exit():
    """init_layer_from_target on a DeepSeek-V3 target with a dense last layer: the untrained MLA drafter's step 0 is
    that layer, the final norm and the head, so its logits are transformers' DeepseekV3ForCausalLM's own. This checks
    the MLA maths against transformers: the latent split, kv_b_proj's per-head layout, DeepSeek's interleaved rope
    with YaRN's frequencies and attention factor, and the softmax scale with YaRN's mscale²."""
    tcfg = deepseek_target()
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(tcfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ids = torch.randint(0, tcfg.vocab_size, (1, 80))  # past original_max_position_embeddings / 2: YaRN matters
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in (0, 1, 2)], -1)  # hidden_states[2]: the last layer's input
    drafter = Drafter(DrafterConfig.from_target(tcfg, tcfg.vocab_size, [0, 1, 2], "mla")).eval()
    assert drafter.layer.self_attn.q_scale > 1.1  # YaRN's mscale² is in play
    drafter.set_vocab(torch.zeros(tcfg.vocab_size, dtype=torch.int64), torch.ones(tcfg.vocab_size, dtype=torch.bool))
    drafter.init_from_target_layer(model.model.layers[2].state_dict())
    with torch.no_grad():
        drafter.lm_head.weight.copy_(model.lm_head.weight)
        drafter.norm.weight.copy_(model.model.norm.weight)
        pos = torch.arange(80)[None]
        embeds = torch.randn(1, 80, tcfg.hidden_size)  # the embedding half starts at zero: any embeddings do
        ours = drafter.logits(drafter.ttt_forward(aux, embeds, pos, torch.zeros_like(pos))[0])[0]
    theirs = out.logits[0]
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert (ours - theirs).abs().max().item() <= 1e-4 * theirs.abs().max().item()


def test_a_layer_that_does_not_map_is_refused_naming_its_shape():
    drafter = Drafter(DrafterConfig.from_target(deepseek_target(), 300, [0, 1, 2], "mla"))
    llama_layer = {"self_attn.q_proj.weight": torch.zeros(64, 64), "mlp.gate_proj.weight": torch.zeros(128, 64)}
    with pytest.raises(ValueError, match="DeepSeek-shaped target layer"):
        drafter.init_from_target_layer(llama_layer)
    # Kimi-K2.5's last layer is MoE: refused before its experts are read from disk
    moe = deepseek_target(layers=3, dense_layers=1)
    with pytest.raises(TrainingError, match="last layer .2. is an MoE layer"):
        init_layer_from_target(drafter, moe, "/nonexistent")


# ------------------------------------------------------------------------------------------ training ----

VOCAB = HIDDEN = 32


def cycle_sequences(n_docs: int, generator) -> list:
    """Documents walking a fixed cycle of the vocabulary from random starts: each next token is determined, and a
    perfect target's final state names it (10 · one-hot, read through an identity head)."""
    order = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))
    succ = torch.empty(VOCAB, dtype=torch.long)
    succ[order] = order.roll(-1)
    out = []
    for _ in range(n_docs):
        n = int(torch.randint(8, 20, (1,), generator=generator))
        ids = [int(torch.randint(0, VOCAB, (1,), generator=generator))]
        for _ in range(n):
            ids.append(int(succ[ids[-1]]))
        ids = torch.tensor(ids)
        final = 10.0 * torch.nn.functional.one_hot(ids[1:], VOCAB).float()
        aux = torch.randn(n, 3 * HIDDEN, generator=generator)
        out.append(Sequence(ids[:-1], torch.ones(n, dtype=torch.uint8), aux, final))
    return out


def test_the_mla_drafter_trains_with_ttt_on_packed_rows():
    """TTT over packed rows (three documents in each of two rows, padding) with the dense attention on the CPU and
    AdamW: the weighted loss over the chain falls to under a third, and every MLA tensor gets a gradient."""
    tcfg = deepseek_target(layers=4, vocab=VOCAB, hidden=HIDDEN)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_target(tcfg, VOCAB, [1, 2, 3], "mla"))
    drafter.set_vocab(*build_draft_vocab(torch.ones(VOCAB), VOCAB))
    embed = torch.randn(VOCAB, HIDDEN)
    g = torch.Generator().manual_seed(1)
    batch = make_batch([cycle_sequences(3, g), cycle_sequences(3, g)], 64)
    assert (batch["doc_ids"] == 2).any() and (batch["doc_ids"] == -1).any()  # packed, padded
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    for step in range(40):
        sums, counts, _, _ = ttt_step.ttt_loss_sums(
            drafter, batch, embed, torch.eye(VOCAB), 3, with_metrics=False, attention="dense"
        )
        loss = sum(0.8**k * s / c for k, (s, c) in enumerate(zip(sums, counts)))
        opt.zero_grad()
        loss.backward()
        if step == 0:
            attn = drafter.layer.self_attn
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in attn.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 3, losses


# -------------------------------------------------------------------------------------- config, params ----


KIMI_MLA_SHAPES = {
    "layers.0.self_attn.q_a_proj.weight": (1536, 14336),
    "layers.0.self_attn.q_a_layernorm.weight": (1536,),
    "layers.0.self_attn.q_b_proj.weight": (64 * 192, 1536),
    "layers.0.self_attn.kv_a_proj_with_mqa.weight": (512 + 64, 14336),
    "layers.0.self_attn.kv_a_layernorm.weight": (512,),
    "layers.0.self_attn.kv_b_proj.weight": (64 * (128 + 128), 512),
    "layers.0.self_attn.o_proj.weight": (7168, 64 * 128),
}


def test_kimi_dims_come_from_the_target_and_the_config_is_torchspecs(kimi_fixtures):
    """From Kimi-K2.5's nested text_config: TorchSpec's MLA drafter dims; config.json round-trips, carries every key of
    TorchSpec's Kimi-K2.5 MLA config with its values (the rope: the target's YaRN), and reads back TorchSpec's own."""
    kimi = WrapperConfig(json.loads((kimi_fixtures / "config.json").read_text()))
    cfg = DrafterConfig.from_target(kimi, 163840, [2, 30, 58], "mla")
    assert cfg.attention_class is MLAAttention and cfg.num_key_value_heads == cfg.num_attention_heads == 64
    d = cfg.to_hf_dict()
    assert DrafterConfig.from_hf_dict(json.loads(json.dumps(d))) == cfg
    torchspec = json.loads((kimi_fixtures / "drafter_configs" / "torchspec_kimi_k25_eagle3_mla.json").read_text())
    assert d["architectures"] == torchspec["architectures"] == [MLA_ARCHITECTURE]
    same = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    same += ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "hidden_act")
    same += ("rms_norm_eps", "vocab_size", "draft_vocab_size", "rope_theta")
    assert {k: d[k] for k in same} == {k: torchspec[k] for k in same}
    assert set(torchspec) - set(d) <= {"torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id"}
    assert d["rope_scaling"]["rope_type"] == "yarn" and d["rope_scaling"]["factor"] == 64.0
    theirs = DrafterConfig.from_hf_dict(torchspec)
    assert theirs.mla_dims == cfg.mla_dims and theirs.rope_parameters["rope_type"] == "yarn"
    assert theirs.aux_layer_ids == [1, 29, 57]
    # the tensors, by name and shape, at Kimi-K2.5's dims (on the meta device: no memory)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Drafter(cfg).state_dict().items()}
    assert {n: s for n, s in shapes.items() if ".self_attn." in n} == KIMI_MLA_SHAPES
    assert sum(torch.Size(s).numel() for s in KIMI_MLA_SHAPES.values()) == 116_262_912
    gqa = DrafterConfig.from_target(kimi, 163840, [2, 30, 58])
    assert (
        gqa.draft_attention == "gqa" and gqa.head_dim == 128 and gqa.to_hf_dict()["architectures"] != [MLA_ARCHITECTURE]
    )


def test_params_refuse_mla_dims_on_gqa_and_a_target_without_them(tmp_path):
    with pytest.raises(ValueError, match="train.mla.kv_lora_rank only apply to train.draft_attention: mla"):
        load_params(TINY_PARAMS, {"train.mla.kv_lora_rank": 512})
    with pytest.raises(ValueError, match="norm_before_fc with draft_attention: mla would train a drafter no engine"):
        load_params(TINY_PARAMS, {"train.draft_attention": "mla", "train.eagle31_norms": ["norm_before_fc"]})
    p = load_params(
        TINY_PARAMS,
        {"train.draft_attention": "mla", "train.init_lm_head_from_target": False, "train.draft_vocab_size": 100},
    )
    llama = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    vocab_maps = build_draft_vocab(torch.ones(300), 100)
    with pytest.raises(TrainingError, match=r"no q_lora_rank .*: give it in train\.mla\.q_lora_rank"):
        initial_drafter(p, llama, {}, None, vocab_maps, [1, 2, 3])
    given = {f"train.mla.{k}": v for k, v in MLA.items()}
    p = load_params(
        TINY_PARAMS,
        {
            "train.draft_attention": "mla",
            "train.init_lm_head_from_target": False,
            "train.draft_vocab_size": 100,
            **given,
        },
    )
    drafter = initial_drafter(p, llama, {}, None, vocab_maps, [1, 2, 3])
    assert drafter.cfg.mla_dims == MLA and drafter.cfg.num_attention_heads == 4
    assert isinstance(drafter.layer.self_attn, MLAAttention)
    with pytest.raises(ValueError, match="MLA dims on a gqa drafter"):
        DrafterConfig(**{**drafter.cfg.as_dict(), "draft_attention": "gqa"})
