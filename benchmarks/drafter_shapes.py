"""The drafter shapes the training benchmarks measure (DrafterConfig's keyword arguments), one place for both
train_step.py and speculators_throughput.py, so that the two measurements always share one."""

LLAMA_8B = dict(
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=14336,
    vocab_size=128256,
    draft_vocab_size=32000,
    target_hidden_size=4096,
    aux_layer_ids=[2, 16, 29],
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)
SMALL = dict(
    LLAMA_8B,
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,
    vocab_size=4096,
    draft_vocab_size=1024,
    target_hidden_size=256,
)

# Kimi-K2.5's draft layer as DrafterConfig.from_target makes it from the model's config (hidden 7168, 64 heads, its
# dense intermediate 18432, YaRN), with a 32,000-token draft vocabulary: GQA (Llama's attention, 64 kv heads of 128)
# and MLA (train.draft_attention: mla, the target's own MLA dims, as TorchSpec's kimi_k25_eagle3_mla.json has them).
KIMI_GQA = dict(
    hidden_size=7168,
    num_attention_heads=64,
    num_key_value_heads=64,
    head_dim=128,
    intermediate_size=18432,
    vocab_size=163840,
    draft_vocab_size=32000,
    target_hidden_size=7168,
    aux_layer_ids=[2, 31, 58],
    rms_norm_eps=1e-5,
    max_position_embeddings=262144,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)
MLA_DIMS = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
KIMI_MLA = dict(KIMI_GQA, head_dim=MLA_DIMS["qk_rope_head_dim"], draft_attention="mla", **MLA_DIMS)
# the --small dry run of the MLA shape: SMALL's widths with latent and head dims cut in proportion
SMALL_MLA = dict(
    SMALL,
    rope_parameters=KIMI_GQA["rope_parameters"],
    head_dim=16,
    draft_attention="mla",
    q_lora_rank=96,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
)
SHAPES = {"llama-8b": (LLAMA_8B, SMALL), "kimi-gqa": (KIMI_GQA, SMALL), "kimi-mla": (KIMI_MLA, SMALL_MLA)}
