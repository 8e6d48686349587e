"""The drafter's TTT forward is exactly the chain an engine runs (the contract behind every accuracy we print)."""

import pytest
import torch

from eagle3lib.drafter import DraftCache, Drafter, DrafterConfig
from eagle3lib.drafter.formats import variant_tensors
from eagle3lib.extract.hf import capture_hidden_states
from eagle3lib.target import default_aux_layer_ids, num_layers

STEPS = 7


def chain_logits(drafter, embed, ids, aux, t, steps, offset=0):
    """Logits of steps 0..steps-1 for the chain starting after position t of a document that
    starts at `offset` in the row, run one token at a time with a KV cache; inputs forced to
    the ground-truth continuation."""
    doc = slice(offset, offset + t + 1)
    cache = DraftCache()
    positions = torch.arange(t + 1)[None]
    hidden, logits = drafter.step(
        cache, embed[ids[:, offset + 1 : offset + t + 2]], aux[:, doc], positions, from_target=True
    )
    out = [logits[0, -1]]
    hidden = hidden[:, -1:]
    for k in range(1, steps):
        token = ids[:, offset + t + 1 + k : offset + t + 2 + k]
        hidden, logits = drafter.step(cache, embed[token], hidden, torch.tensor([[t + k]]), from_target=False)
        out.append(logits[0, -1])
    return out


@pytest.fixture(scope="module")
def real_states(embedded_target):
    """A real conversation through the real SmolLM2: its ids, aux states and a drafter of its shape."""
    model, tokenizer = embedded_target
    text = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "Name three rivers in Europe and say which is longest."},
            {"role": "assistant", "content": "The Danube, the Rhine and the Volga. The Volga is the longest."},
        ],
        tokenize=False,
    )
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    aux_ids = default_aux_layer_ids(num_layers(model.config))
    aux, _ = capture_hidden_states(model, ids, torch.ones_like(ids), aux_ids)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_target(model.config, 512, aux_ids)).eval()
    embed = model.get_input_embeddings().weight.detach()
    return ids, aux.float(), drafter, embed


def test_ttt_equals_chain_on_real_states(real_states):
    ids, aux, drafter, embed = real_states
    n = ids.shape[1] - STEPS - 1
    pos = torch.arange(n)[None]
    embeds = embed[ids[:, 1 : n + STEPS]]  # step k at t: token t+1+k
    with torch.no_grad():
        hidden = drafter.ttt_forward(aux[:, :n], embeds, pos, torch.zeros_like(pos))
        worst = 0.0
        for t in (0, 1, n // 2, n - 1):
            chain = chain_logits(drafter, embed, ids, aux, t, STEPS)
            for k in range(STEPS):
                diff = (drafter.logits(hidden[k])[0, t] - chain[k]).abs().max().item()
                worst = max(worst, diff)
    assert worst <= 1e-4, f"TTT and chain logits differ by {worst}"


SPECULATORS_DEFAULT = {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True}


@pytest.mark.parametrize("variants", [SPECULATORS_DEFAULT, {"fc_norm": True}, {"norm_output": True}])
def test_eagle31_variants_ttt_equals_chain_and_change_the_drafter(real_states, variants):
    """EAGLE-3.1's norms (speculators' eagle3 defaults among them): TTT and the engine's chain agree, each flag
    changes the logits (it is not ignored), and the flags survive config.json."""
    ids, aux, base, embed = real_states
    cfg = DrafterConfig(**{**base.cfg.as_dict(), **variants})
    assert DrafterConfig.from_hf_dict(cfg.to_hf_dict()) == cfg and cfg.variants == variants
    torch.manual_seed(1)
    drafter = Drafter(cfg).eval()
    state = base.state_dict()
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) == set(variant_tensors(variants))
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "norm" in name and name not in state:
                param.uniform_(0.5, 1.5)  # an RMSNorm at its init (ones) would hide a misplaced norm's weight
    n = ids.shape[1] - STEPS - 1
    pos = torch.arange(n)[None]
    embeds = embed[ids[:, 1 : n + STEPS]]
    with torch.no_grad():
        hidden = drafter.ttt_forward(aux[:, :n], embeds, pos, torch.zeros_like(pos))
        plain = base.ttt_forward(aux[:, :n], embeds, pos, torch.zeros_like(pos))
        for t in (0, n // 2, n - 1):
            chain = chain_logits(drafter, embed, ids, aux, t, STEPS)
            for k in range(STEPS):
                assert (drafter.logits(hidden[k])[0, t] - chain[k]).abs().max().item() <= 1e-4, (t, k)
        # step 0 differs from the plain drafter unless only norm_output is on (it acts from step 1)
        first_changed = 0 if set(variants) != {"norm_output"} else 1
        diff = (drafter.logits(hidden[first_changed]) - base.logits(plain[first_changed])).abs().max().item()
        assert diff > 1e-3, f"{variants} left the logits unchanged"


def test_packed_documents_do_not_see_each_other(real_states):
    """Two documents in one row: TTT on the packed row equals the chain run on each document alone."""
    ids, aux, drafter, embed = real_states
    a = 12
    n = ids.shape[1] - STEPS - 1
    # The row: positions 0..a-1 of the conversation as doc 0, then the whole conversation again as doc 1
    # (its first n positions, then its continuation, as a packed row of the trainer reads on).
    row_aux = torch.cat([aux[:, :a], aux[:, :n]], 1)
    row_ids = torch.cat([ids[:, :a], ids], 1)
    pos = torch.cat([torch.arange(a), torch.arange(n)])[None]
    docs = torch.cat([torch.zeros(a, dtype=torch.long), torch.ones(n, dtype=torch.long)])[None]
    embeds = embed[row_ids[:, 1 : a + n + STEPS]]
    with torch.no_grad():
        hidden = drafter.ttt_forward(row_aux, embeds, pos, docs)
        for t in (3, n - 1):
            chain = chain_logits(drafter, embed, ids, aux, t, STEPS)
            for k in range(STEPS):
                diff = (drafter.logits(hidden[k])[0, a + t] - chain[k]).abs().max().item()
                assert diff <= 1e-4, (t, k, diff)


def test_config_round_trip_and_canonical_names(real_states):
    _, _, drafter, _ = real_states
    cfg = drafter.cfg
    d = cfg.to_hf_dict()
    assert d["architectures"] == ["LlamaForCausalLMEagle3"] and d["draft_vocab_size"] == 512
    assert d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert d["tie_word_embeddings"] is False
    assert DrafterConfig.from_hf_dict(d) == cfg
    names = set(drafter.state_dict())
    assert {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        "layers.0.hidden_norm.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.mlp.gate_proj.weight",
    } <= names
    assert not any("embed" in n or "rotary" in n for n in names)
    assert drafter.layers[0].self_attn.q_proj.in_features == 2 * cfg.hidden_size
    assert drafter.fc.in_features == 3 * cfg.target_hidden_size


def test_flex_attention_path_equals_the_dense_one():
    """The GPU path (flex_attention with a block mask) computes what the dense CPU path does,
    packed documents and padding included."""
    torch.manual_seed(0)
    cfg = DrafterConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=300,
        draft_vocab_size=100,
        target_hidden_size=48,
        aux_layer_ids=[1, 2, 3],
    )
    drafter = Drafter(cfg).eval()
    t = 40
    aux = torch.randn(2, t, 144)
    embeds = torch.randn(2, t + 3, 64)  # 4 steps
    docs = torch.tensor([[0] * 15 + [1] * 20 + [-1] * 5, [0] * 40])
    pos = torch.cat([torch.arange(15), torch.arange(20), torch.zeros(5, dtype=torch.long)])[None].repeat(2, 1)
    pos[1] = torch.arange(40)
    with torch.no_grad():
        dense = drafter.ttt_forward(aux, embeds, pos, docs, attention="dense")
        flex = drafter.ttt_forward(aux, embeds, pos, docs, attention="flex")
    real = docs >= 0
    for a, b in zip(dense, flex):
        assert (a - b)[real].abs().max() <= 1e-5


def several_block_case(device):
    """Sequences over several 128-blocks (not a whole number of them), documents that span and
    fill blocks (so some blocks are full), padding."""
    torch.manual_seed(1)
    # head_dim 16: flex_attention's Triton kernels need at least 16
    cfg = DrafterConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        vocab_size=300,
        draft_vocab_size=100,
        target_hidden_size=24,
        aux_layer_ids=[1, 2, 3],
    )
    t = 300
    lengths = [[90, 170, 30], [260, 27]]  # row 1 ends in 13 padding positions
    docs = torch.full((2, t), -1)
    pos = torch.zeros(2, t, dtype=torch.long)
    for r, row in enumerate(lengths):
        start = 0
        for d, n in enumerate(row):
            docs[r, start : start + n] = d
            pos[r, start : start + n] = torch.arange(n)
            start += n
    aux = torch.randn(2, t, 72)
    embeds = torch.randn(2, t + 2, 64)  # 3 steps
    to = lambda x: x.to(device)  # noqa: E731
    return Drafter(cfg).to(device), to(aux), to(embeds), to(pos), to(docs)


def test_flex_block_masks_over_several_blocks_equal_the_dense_path():
    from eagle3lib.drafter.ttt_attention import ttt_block_masks

    drafter, aux, embeds, pos, docs = several_block_case("cpu")
    full_blocks = ttt_block_masks(torch.nn.functional.pad(docs, (0, 84), value=-1), 300, 1)[0].full_kv_num_blocks
    assert full_blocks.sum() > 0  # full blocks are covered, not only partial ones
    real = docs >= 0
    with torch.no_grad():
        dense = drafter.ttt_forward(aux, embeds, pos, docs, attention="dense")
        flex = drafter.ttt_forward(aux, embeds, pos, docs, attention="flex")
    for a, b in zip(dense, flex):
        assert (a - b)[real].abs().max() <= 1e-5


# Relative error a position's gradient may carry: a few roundings of the compute dtype (TF32 keeps 10 mantissa
# bits, bf16 7). A mask error at a block edge puts a few positions off by O(1), which a tolerance on the largest
# gradient over all positions would dilute.
TF32_EPS, BF16_EPS = 2.0**-10, 2.0**-7


def input_gradients(drafter, aux, embeds, pos, docs, **kw) -> dict:
    """{aux, embeds}: each input position's gradient of a loss over the TTT outputs at real positions."""
    aux, embeds = aux.detach().clone().requires_grad_(), embeds.detach().clone().requires_grad_()
    real = (docs >= 0)[..., None]
    outs = drafter.ttt_forward(aux, embeds, pos, docs, **kw)
    aux_grad, embeds_grad = torch.autograd.grad(sum(((o.float() * real) ** 2).sum() for o in outs), [aux, embeds])
    return {"aux": aux_grad.float(), "embeds": embeds_grad.float()}


def assert_per_position(ref: dict, got: dict, rtol: float, what: str):
    for name, r in ref.items():
        err, scale = (r - got[name]).norm(dim=-1), r.norm(dim=-1)
        floor = 1e-3 * scale.max()  # positions without gradient (padding, past the chain)
        bad = err > rtol * scale + floor
        worst = (err / (scale + floor)).max().item()
        assert not bad.any(), (
            f"{what}: {name} gradient off at (row, position) {bad.nonzero()[:8].tolist()}, worst {worst:.3g}"
        )


def test_per_position_gradients_catch_one_position_off():
    """The GPU tests' comparison on the CPU: one position's gradient off by 30% fails it; rounding noise does not."""
    drafter, aux, embeds, pos, docs = several_block_case("cpu")
    ref = input_gradients(drafter, aux, embeds, pos, docs, attention="dense")
    noisy = {n: g * (1 + BF16_EPS * torch.randn_like(g)) for n, g in ref.items()}
    assert_per_position(ref, noisy, 8 * BF16_EPS, "noise")
    off = {n: g.clone() for n, g in ref.items()}
    off["aux"][1, 90] *= 1.3  # the first position of a document
    with pytest.raises(AssertionError, match=r"aux gradient off at \(row, position\) \[\[1, 90\]\]"):
        assert_per_position(ref, off, 8 * BF16_EPS, "planted")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention has no backward on the CPU")
def test_flex_gradients_with_and_without_checkpointing_equal_the_dense_path():
    drafter, aux, embeds, pos, docs = several_block_case("cuda")
    real = docs >= 0

    def grads(**kw):
        drafter.zero_grad()
        outs = drafter.ttt_forward(aux, embeds, pos, docs, **kw)
        sum(((o * real[..., None]) ** 2).sum() for o in outs).backward()
        return {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}

    dense = grads(attention="dense")
    dense_inputs = input_gradients(drafter, aux, embeds, pos, docs, attention="dense")
    for checkpoint in (False, True):
        flex = grads(attention="flex", checkpoint=checkpoint)
        for name, g in dense.items():
            # flex's Triton kernel multiplies fp32 in TF32 (~1e-3 relative); a wrong mask is off by O(1).
            assert (g - flex[name]).abs().max() <= 1e-2 * g.abs().max(), (checkpoint, name)
        got = input_gradients(drafter, aux, embeds, pos, docs, attention="flex", checkpoint=checkpoint)
        assert_per_position(dense_inputs, got, 8 * TF32_EPS, f"flex, checkpoint={checkpoint}")


def one_document_case(device):
    """Rows of one document each, GQA, one row ending in padding: the case of the merged path."""
    torch.manual_seed(2)
    cfg = DrafterConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        vocab_size=300,
        draft_vocab_size=100,
        target_hidden_size=24,
        aux_layer_ids=[1, 2, 3],
    )
    t = 150
    docs = torch.zeros(2, t, dtype=torch.long)
    docs[1, 131:] = -1
    pos = torch.arange(t).repeat(2, 1) * (docs >= 0)
    to = lambda x: x.to(device)  # noqa: E731
    return Drafter(cfg).to(device), to(torch.randn(2, t, 72)), to(torch.randn(2, t + 3, 64)), to(pos), to(docs)


def ttt_outputs_and_grads(drafter, aux, embeds, pos, docs, **kw):
    """The TTT outputs at real positions and the parameters' gradients of a loss over them."""
    drafter.zero_grad()
    real = (docs >= 0)[..., None]
    outs = drafter.ttt_forward(aux, embeds, pos, docs, **kw)
    sum(((o.float() * real) ** 2).sum() for o in outs).backward()
    return [o.float() * real for o in outs], {
        n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None
    }


def assert_close(ref, got, tol, what):
    for o_ref, o_got in zip(ref[0], got[0]):
        assert (o_ref - o_got).abs().max() <= tol * o_ref.abs().max(), f"{what}: outputs"
    assert ref[1].keys() == got[1].keys()
    for name, g in ref[1].items():
        assert (g - got[1][name]).abs().max() <= tol * g.abs().max(), f"{what}: {name}"


def test_merged_attention_equals_the_dense_path_forward_and_backward():
    """The one-document path (causal attention with its log-sum-exp, merged with the diagonal keys;
    its backward hands the merged statistics to the causal kernel's backward) computes the dense path's
    outputs and gradients. Here with the reference kernel pair; tests/unit/test_drafter.py's CUDA test runs cuDNN's."""
    case = one_document_case("cpu")
    dense = ttt_outputs_and_grads(*case, attention="dense")
    for checkpoint in (False, True):
        assert_close(
            dense,
            ttt_outputs_and_grads(*case, attention="merged", checkpoint=checkpoint),
            1e-4,
            f"merged, checkpoint={checkpoint}",
        )
        assert_close(
            dense,
            ttt_outputs_and_grads(*case, attention="dense", checkpoint=checkpoint),
            1e-5,
            f"dense, checkpoint={checkpoint}",
        )


def test_compiled_merge_equals_the_eager_merge():
    """merge_kernels' torch.compile'd merge and diagonal gradients (train.compile_layer; here inductor's CPU
    code) compute what the eager functions do, for GQA heads and two diagonal steps."""
    from eagle3lib.drafter.ttt_attention import causal_attention_with_diagonals

    torch.manual_seed(3)
    b, heads, kv, t, d = 2, 4, 2, 40, 16
    q, k0, v0 = (torch.randn(b, heads, t, d, requires_grad=True) for _ in range(3))
    diag = [torch.randn(b, kv, t, d, requires_grad=True) for _ in range(4)]
    dout = torch.randn(b, heads, t, d)
    results = []
    for compiled in (False, True):
        out = causal_attention_with_diagonals(q, k0, v0, diag[:2], diag[2:], compiled=compiled)
        grads = torch.autograd.grad(out, [q, k0, v0, *diag], dout)
        results.append((out, grads))
    (out_eager, g_eager), (out_compiled, g_compiled) = results
    torch.testing.assert_close(out_compiled, out_eager, rtol=1e-5, atol=1e-5)
    for a, c in zip(g_eager, g_compiled):
        torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-5)


def test_compiled_layer_trains_as_the_eager_one():
    """train.compile_layer (compile_decoder_layer: q/k/v, o_proj, MLP, the merge, the output norm, all through
    torch.compile; here inductor's CPU code) changes neither the TTT outputs and gradients nor the names
    the checkpoint is saved under."""
    from eagle3lib.train.runtime.speedups import compile_decoder_layer

    drafter, aux, embeds, pos, docs = one_document_case("cpu")
    names = list(drafter.state_dict())
    eager = ttt_outputs_and_grads(drafter, aux, embeds, pos, docs, attention="merged")
    compile_decoder_layer(drafter)
    assert drafter.compile_merge and list(drafter.state_dict()) == names
    assert_close(eager, ttt_outputs_and_grads(drafter, aux, embeds, pos, docs, attention="merged"), 1e-4, "compiled")


def test_one_document_rows_decides_which_fused_kernel_the_merged_path_runs():
    from eagle3lib.drafter.ttt_attention import one_document_rows

    assert one_document_rows(torch.tensor([[0, 0, 0, -1, -1], [3, 3, 3, 3, 3]]))
    assert not one_document_rows(torch.tensor([[0, 0, 1, 1, -1]]))  # packed
    assert not one_document_rows(torch.tensor([[0, 0, -1, 0, 0]]))  # a real position after padding
    assert not one_document_rows(torch.tensor([[-1, -1, -1]]))  # padding only
    drafter, aux, embeds, pos, docs = several_block_case("cpu")
    with pytest.raises(ValueError, match="T\\+K-1"):
        drafter.ttt_forward(aux, embeds[:, :10], pos, docs)


def test_packed_segments_are_the_runs_of_each_row():
    """Each row's documents and its padding run are separate sequences of the flattened rows, and no run crosses
    from one row into the next (row 0 ends in document 1, row 1 starts with its own document 1)."""
    from eagle3lib.drafter.ttt_attention import packed_segments

    seg = packed_segments(torch.tensor([[0, 0, 0, 1, 1], [1, 1, 2, -1, -1]]))
    assert seg.cu_seqlens.tolist() == [0, 3, 5, 7, 8, 10] and seg.cu_seqlens.dtype == torch.int32
    assert seg.max_len == 3
    assert seg.segment_ids.tolist() == [[0, 0, 0, 1, 1], [2, 2, 3, 4, 4]]


def test_merged_attention_on_packed_rows_equals_the_dense_path():
    """Packed rows (documents across 128-blocks, padding at a row's end, GQA): the variable-length causal part
    (here its CPU reference: causal within each run of the flattened rows) merged with the diagonals computes the
    dense path's outputs and gradients, with and without checkpointing; "varlen" forces it on one-document rows."""
    case = several_block_case("cpu")
    dense = ttt_outputs_and_grads(*case, attention="dense")
    for checkpoint in (False, True):
        got = ttt_outputs_and_grads(*case, attention="merged", checkpoint=checkpoint)
        assert_close(dense, got, 1e-4, f"merged on packed rows, checkpoint={checkpoint}")
    one_doc = one_document_case("cpu")
    assert_close(
        ttt_outputs_and_grads(*one_doc, attention="dense"),
        ttt_outputs_and_grads(*one_doc, attention="varlen"),
        1e-4,
        "varlen on one-document rows",
    )


def test_a_document_boundary_off_by_one_changes_the_packed_merged_path():
    """The packed path's mask matters: the same rows with one document boundary moved give other outputs at the
    documents it touches (a kernel that ignored the segments would pass the equality test above only by luck)."""
    drafter, aux, embeds, pos, docs = several_block_case("cpu")
    with torch.no_grad():
        ref = drafter.ttt_forward(aux, embeds, pos, docs, attention="merged")
        moved = docs.clone()
        moved[0, 90] = 0  # document 1 of row 0 now starts one position later
        got = drafter.ttt_forward(aux, embeds, pos, moved, attention="merged")
    assert (ref[0][0, 91:120] - got[0][0, 91:120]).abs().max() > 1e-3
    assert (ref[0][0, :90] - got[0][0, :90]).abs().max() <= 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN attention runs on CUDA")
def test_merged_cudnn_path_equals_the_dense_path_on_gpus():
    """cuDNN's causal kernel and its backward fed the merged log-sum-exp (bf16 under autocast) against the
    dense path in fp32: a wrong merge or a log-sum-exp in other units is off by O(1), bf16 by ~1e-2."""
    case = one_document_case("cuda")
    dense = ttt_outputs_and_grads(*case, attention="dense")
    dense_inputs = input_gradients(*case, attention="dense")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for compiled, checkpoint in [(False, False), (False, True), (True, False), (True, True)]:
            case[0].compile_merge = compiled  # the merge through Triton (train.compile_layer)
            what = f"merged on cuDNN, compiled merge={compiled}, checkpoint={checkpoint}"
            assert_close(dense, ttt_outputs_and_grads(*case, attention="merged", checkpoint=checkpoint), 5e-2, what)
            got = input_gradients(*case, attention="merged", checkpoint=checkpoint)
            assert_per_position(dense_inputs, got, 8 * BF16_EPS, what)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention runs on CUDA")
def test_merged_varlen_path_on_packed_rows_equals_the_dense_path_on_gpus():
    """Flash attention's variable-length causal kernel and its backward fed the merged log-sum-exp, on packed rows
    with padding and GQA (bf16 under autocast), against the dense path in fp32, per position: a document boundary
    off by one, or a log-sum-exp in other units, is off by O(1) at the positions it touches."""
    case = several_block_case("cuda")
    dense = ttt_outputs_and_grads(*case, attention="dense")
    dense_inputs = input_gradients(*case, attention="dense")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for compiled, checkpoint in [(False, False), (True, False), (True, True)]:
            case[0].compile_merge = compiled
            what = f"merged on flash varlen, compiled merge={compiled}, checkpoint={checkpoint}"
            assert_close(dense, ttt_outputs_and_grads(*case, attention="auto", checkpoint=checkpoint), 5e-2, what)
            got = input_gradients(*case, attention="merged", checkpoint=checkpoint)
            assert_per_position(dense_inputs, got, 8 * BF16_EPS, what)
    one_doc = one_document_case("cuda")
    ref = input_gradients(*one_doc, attention="dense")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = input_gradients(*one_doc, attention="varlen")
    assert_per_position(ref, got, 8 * BF16_EPS, "varlen, one document")


def test_auto_attention_keeps_fp32_off_the_fused_kernels():
    """cuDNN takes fp16/bf16 only and its raw op returns wrong scores for fp32 instead of failing (an fp32 drafter
    evaluated on one-document rows on an H200 scored cond_acc 0.07 where dense and flex scored 0.29): auto sends fp32 to flex."""
    from eagle3lib.drafter.ttt_attention import auto_attention

    assert auto_attention(is_cuda=True, half_precision=True) == "merged"
    assert auto_attention(is_cuda=True, half_precision=False) == "flex"
    assert auto_attention(is_cuda=False, half_precision=True) == "dense"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN attention runs on CUDA")
def test_fp32_on_gpus_is_refused_by_merged_and_right_through_auto():
    case = one_document_case("cuda")
    with pytest.raises(ValueError, match="fp16/bf16 only"):
        ttt_outputs_and_grads(*case, attention="merged")
    assert_close(ttt_outputs_and_grads(*case, attention="dense"), ttt_outputs_and_grads(*case), 1e-4, "auto, fp32")


def test_block_masks_built_per_block_equal_the_ones_flex_builds_pair_by_pair():
    """The kernels on GPUs skip blocks by these lists (the CPU path evaluates every pair), so the lists
    themselves must equal create_block_mask's, partial and full blocks, for every TTT step."""
    from torch.nn.attention.flex_attention import create_block_mask

    from eagle3lib.drafter.ttt_attention import ttt_block_masks

    t, t_pad = 300, 384
    docs = torch.full((2, t_pad), -1)
    for r, row in enumerate([[90, 170, 30], [260, 27]]):
        start = 0
        for d, n in enumerate(row):
            docs[r, start : start + n] = d
            start += n
    ours = ttt_block_masks(docs, t, 3)
    for k in range(3):

        def mask_mod(b, h, q, kv):
            region, pos = kv // t_pad, kv % t_pad
            same_doc = (docs[b, q] == docs[b, pos]) & (docs[b, q] >= 0)
            return torch.where(region == 0, ((pos <= q) & same_doc) | (pos == q), pos == q)

        ref = create_block_mask(mask_mod, 2, None, t, t_pad * (k + 1), device="cpu")
        assert torch.equal(ours[k].kv_num_blocks, ref.kv_num_blocks)
        assert torch.equal(ours[k].full_kv_num_blocks, ref.full_kv_num_blocks)
        assert torch.equal(ours[k].to_dense(), ref.to_dense())


def test_starting_from_the_targets_last_layer_is_an_exact_early_exit(embedded_target, tmp_path):
    """train.init_layer_from_target: with the top aux state at the last layer's input, the untrained drafter's
    step 0 is the target's last layer, final norm and head, so its logits are the target's own."""
    from safetensors.torch import save_file

    from eagle3lib.target import load_layer_tensors

    model, tokenizer = embedded_target
    last = num_layers(model.config) - 1
    ids = tokenizer("The Danube, the Rhine and the Volga are rivers.", return_tensors="pt").input_ids
    aux_ids = [2, 15, last]  # hidden_states[last] = the last layer's input
    aux, _ = capture_hidden_states(model, ids, torch.ones_like(ids), aux_ids)
    vocab = model.config.vocab_size
    drafter = Drafter(DrafterConfig.from_target(model.config, vocab, aux_ids)).float().eval()
    drafter.set_vocab(torch.zeros(vocab, dtype=torch.int64), torch.ones(vocab, dtype=torch.bool))
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items() if ".layers." in k}
    save_file(state, tmp_path / "model.safetensors")
    layer = load_layer_tensors(str(tmp_path), last)
    assert set(layer) >= {"self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"}
    drafter.init_from_target_layer(layer)
    with torch.no_grad():
        drafter.lm_head.weight.copy_(model.get_output_embeddings().weight)
        drafter.norm.weight.copy_(model.model.norm.weight)
        n = ids.shape[1]
        pos = torch.arange(n)[None]
        embeds = model.get_input_embeddings().weight[ids[:, 1:]].float()
        embeds = torch.cat([embeds, embeds[:, -1:]], 1)  # step 0 reads token t+1; the last one is padding
        hidden = drafter.ttt_forward(aux.float(), embeds, pos, torch.zeros_like(pos))
        ours = drafter.logits(hidden[0])[0]
        theirs = model(ids).logits[0]
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert (ours - theirs).abs().max().item() <= 1e-3 * theirs.abs().max().item()
    with pytest.raises(ValueError, match="Llama-shaped"):
        drafter.init_from_target_layer({k: v[:1] for k, v in layer.items()})


@pytest.mark.parametrize("variants", [SPECULATORS_DEFAULT | {"norm_before_residual": False}, {"fc_norm": True}])
def test_eagle31_norms_keep_the_chain_in_autocasts_dtype(real_states, monkeypatch, variants):
    """Under bf16 autocast every TTT step hands the fused causal kernel bf16 q/k/v: norm_output's fp32 weight once
    promoted the next step's state, its rope and so q to fp32, which the H200's kernels refuse."""
    from eagle3lib.drafter import model as drafter_model

    ids, aux, base, embed = real_states
    drafter = Drafter(DrafterConfig(**{**base.cfg.as_dict(), **variants}))
    seen = []

    def recording(q, k, v, *rest, **kw):
        seen.append({q.dtype, k.dtype, v.dtype})
        return causal(q, k, v, *rest, **kw)

    causal = drafter_model.causal_attention_with_diagonals
    monkeypatch.setattr(drafter_model, "causal_attention_with_diagonals", recording)
    n = ids.shape[1] - STEPS - 1
    pos = torch.arange(n)[None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        drafter.ttt_forward(aux[:, :n], embed[ids[:, 1 : n + STEPS]], pos, torch.zeros_like(pos), attention="merged")
    assert seen == [{torch.bfloat16}] * STEPS


def test_flex_tiles_fit_wide_fp32_heads():
    """An MLA drafter's 192-wide fp32 heads (our validation, the predicted AL) get smaller flex tiles on GPUs; the
    GQA drafter's 64-wide ones and half precision keep flex's defaults (tests/gpu/test_drafter_dtypes.py runs
    both on a GPU; on an H200 the defaults asked 279,808 bytes of shared memory of 232,448)."""
    from eagle3lib.drafter.ttt_attention import WIDE_FP32_TILES, flex_tiles

    assert flex_tiles(torch.float32, 192) == WIDE_FP32_TILES
    assert flex_tiles(torch.float32, 128) is None and flex_tiles(torch.bfloat16, 192) is None


def test_compiled_layer_compiles_while_a_target_runs_in_another_thread():
    """train.source online with the thread placement: the hf capture runs the target's forward in a thread while the
    trainer torch.compiles its layer. transformers' LlamaAttention publishes its hub-kernel functions in a variable
    that `kernels` makes process-wide once anything compiles; a drafter that called transformers'
    apply_rotary_pos_emb read the target's entry mid-forward and dynamo failed ("Unexpected type <class 'dict'>")."""
    import threading

    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3lib.train.runtime.speedups import compile_decoder_layer

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)  # fmt: skip
    target, stop = LlamaForCausalLM(config).eval(), threading.Event()
    ids = torch.randint(0, 256, (1, 128))

    def capture():
        with torch.no_grad():
            while not stop.is_set():
                target(ids)

    thread = threading.Thread(target=capture, daemon=True)
    thread.start()
    try:
        drafter, aux, embeds, pos, docs = one_document_case("cpu")
        eager = ttt_outputs_and_grads(drafter, aux, embeds, pos, docs, attention="merged")
        torch.compiler.reset()  # compiled here, beside the target, not taken from another test's compile
        compile_decoder_layer(drafter)
        compiled = ttt_outputs_and_grads(drafter, aux, embeds, pos, docs, attention="merged")
    finally:
        stop.set()
        thread.join()
    assert_close(eager, compiled, 1e-4, "compiled beside a running target")
