"""The drafter shapes the training benchmarks measure (DrafterConfig's keyword arguments), one place for both
train_throughput.py and speculators_throughput.py, so that the two measurements always share one."""

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
