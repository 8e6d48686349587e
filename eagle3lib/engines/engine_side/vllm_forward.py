"""The draft's forward in vLLM's own model class on given inputs (load_check.py's vllm-forward), attention by a plain
causal softmax in place of the engine's kernels, to compare with our Drafter.step. Standalone (stdlib, torch,
safetensors and vLLM only)."""

from vllm_load import vllm_draft


def plain_causal_attention(attn):
    """A stand-in for vLLM's Attention.forward over one sequence (q, k, v after its rotary embedding, [T, heads *
    head_dim]): causal softmax attention with its scale and GQA. The kernels need the engine's batch metadata;
    what is compared is the model around them (fc, norms, the embeds/hidden order, q/k/v split, rotary, MLP)."""
    import torch.nn.functional as F

    heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_size

    def forward(query, key, value, *args, **kwargs):
        t = query.shape[0]
        q = query.view(t, heads, head_dim).transpose(0, 1)
        k = key.view(t, kv_heads, head_dim).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        v = value.view(t, kv_heads, head_dim).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=attn.impl.scale)
        return out[0].transpose(0, 1).reshape(t, heads * head_dim).to(query.dtype)

    return forward


def plain_mla_attention(mla):
    """A stand-in for vLLM's MLAAttention.forward over one sequence: q [T, heads, qk_nope + qk_rope] after the rotary,
    the normed latent kv_c [T, kv_lora_rank] and the rotated shared key k_pe [T, 1, qk_rope]. k_nope and v come from
    the kv_b_proj vLLM loaded, then causal softmax with its scale (YaRN's mscale² in it). vLLM's kernels absorb
    kv_b_proj into q and the output to attend over the latent cache, the same scores; they need the engine's batch
    metadata. What is compared is the model around them (the fused q/latent projection of the 2H input, the q and
    latent norms, q_b_proj, the latent split, the interleaved YaRN rotary, kv_b_proj's per-head layout, o_proj)."""
    import torch
    import torch.nn.functional as F

    heads, nope, v_dim = mla.num_heads, mla.qk_nope_head_dim, mla.v_head_dim

    def forward(q, kv_c_normed, k_pe, output_shape=None, **kwargs):
        t = q.shape[0]
        k_nope, v = mla.kv_b_proj(kv_c_normed)[0].view(t, heads, nope + v_dim).split([nope, v_dim], -1)
        k = torch.cat([k_nope, k_pe.expand(t, heads, k_pe.shape[-1])], -1)
        by_head = lambda x: x.transpose(0, 1)[None]  # noqa: E731
        out = F.scaled_dot_product_attention(by_head(q), by_head(k), by_head(v), is_causal=True, scale=mla.scale)
        return out[0].transpose(0, 1).reshape(t, heads * v_dim).to(q.dtype)

    return forward


def forward_vllm(draft, target, inputs, out):
    """vLLM's Eagle3LlamaForCausalLM (or, for an MLA draft, Eagle3DeepseekV2ForCausalLM) forward on one sequence: inputs (safetensors) holds input_embeds [T, H] (the
    target's embeddings of the tokens fed), aux [T, 3 H_t] and positions [T]; out gets its logits over the target
    vocabulary (compute_logits: draft rows mapped through d2t, -inf elsewhere) and the pre-norm hidden state."""
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    vllm_config, draft_cfg, model, problems, _ = vllm_draft(draft, target, 1)
    if problems:
        return {"engine": "vllm", "ok": False, "problems": problems}
    with set_current_vllm_config(vllm_config):  # as the loader finishes a load: the CPU linear kernels' set-up
        process_weights_after_loading(model, draft_cfg, torch.device("cpu"))
    x = load_file(inputs)
    for layer in model.model.layers:
        if hasattr(layer.self_attn, "mla_attn"):  # DeepseekV2MLAAttention: the MLAAttention inside its wrapper
            inner = layer.self_attn.mla_attn.mla_attn
            inner.forward = plain_mla_attention(inner)
        else:
            layer.self_attn.attn.forward = plain_causal_attention(layer.self_attn.attn)
    with torch.inference_mode(), set_current_vllm_config(vllm_config), set_forward_context(None, vllm_config):
        hidden = model.combine_hidden_states(x["aux"])
        positions = x["positions"].long()
        ids = torch.zeros_like(positions)  # unused: the embeddings are given
        normed, prenorm = model(ids, positions, hidden, x["input_embeds"])
        logits = model.compute_logits(normed)
    save_file({"logits": logits.float().contiguous(), "prenorm": prenorm.float().contiguous()}, out)
    return {"engine": "vllm", "ok": True, "problems": [], "model_class": type(model).__name__, "out": out}
