"""A drafter written by the speculators package itself (tests/e2e/test_convert_foreign.py runs this in .venv-speculators,
`make speculators-env`: speculators 0.9.0 pins transformers <= 5.19, older than .venv's).

    python speculators_save.py TARGET_DIR OUT_DIR '[aux ids]' DRAFT_VOCAB

The drafter is made the way speculators' own training entry point makes it (its transformer_layer_config from the
target, `Eagle3DraftModel.from_training_args`, the target's embeddings and lm_head rows loaded from TARGET_DIR),
with a random draft vocabulary and full attention, and saved with `save_pretrained`. Prints {"ok": true}.
"""

import json
import sys

import torch
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.train.cli import create_transformer_layer_config
from transformers import AutoConfig

target, out, aux, draft_vocab = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
layer_config = create_transformer_layer_config(
    verifier_name_or_path=target,
    num_layers=1,
    draft_arch="llama",
    hidden_act=None,
    sliding_window=None,
    full_attention_indices=[0],  # speculators' training default is a 2048-token sliding window; ours has none
)
vocab = AutoConfig.from_pretrained(target).vocab_size
kept = torch.sort(torch.randperm(vocab)[:draft_vocab]).values  # the draft vocabulary's target ids, in order
t2d = torch.zeros(vocab, dtype=torch.bool)
t2d[kept] = True
model = Eagle3DraftModel.from_training_args(
    verifier_config=layer_config,
    t2d=t2d,
    d2t=kept - torch.arange(draft_vocab),
    draft_vocab_size=draft_vocab,
    norm_before_residual=False,
    ttt_steps=3,
    verifier_name_or_path=target,
    target_layer_ids=aux,
)
model.save_pretrained(out)
print(json.dumps({"ok": True}))
