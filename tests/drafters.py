"""Drafters for tests: a tiny one of the target's interface, and one that has learned a continuation."""

import torch
import torch.nn.functional as F

from eagle3lib.drafter import Drafter, DrafterConfig, vocab
from eagle3lib.extract.hf import capture_hidden_states
from eagle3lib.speedup import replay
from eagle3lib.target import default_aux_layer_ids, num_layers

MAX_TOKENS = 32
TTT_STEPS = 3
PROMPTS = ["List the days of the week, one per line.", "What is the capital of France? Answer in one sentence."]


def chat_ids(tokenizer, text):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def tiny_drafter(model, counts, seed=0):
    """A small drafter of the target's interface: 4 heads of 32, MLP 256, a 512-token draft vocabulary."""
    torch.manual_seed(seed)
    aux_ids = default_aux_layer_ids(num_layers(model.config))
    cfg = DrafterConfig.from_target(model.config, 512, aux_ids)
    cfg.num_attention_heads = cfg.num_key_value_heads = 4
    cfg.head_dim, cfg.intermediate_size = 32, 256
    drafter = Drafter(cfg)
    drafter.set_vocab(*vocab.build_draft_vocab(counts, 512))
    return drafter.eval()


def learned_drafter(model, tokenizer) -> dict:
    """{prompts, greedy, counts, drafter}: PROMPTS as chat token ids, their greedy continuations (MAX_TOKENS, one
    token per forward), the token counts the draft vocabulary came from, and a tiny drafter trained (TTT, 80
    Adam steps) on the first prompt's continuation, so that its drafts there are accepted."""
    prompts = [chat_ids(tokenizer, text) for text in PROMPTS]
    greedy = [replay.greedy_decode(model, ids, MAX_TOKENS) for ids in prompts]
    seq = torch.tensor([prompts[0] + greedy[0]])
    counts = torch.bincount(torch.tensor(sum(prompts, []) + sum(greedy, [])), minlength=model.config.vocab_size)
    learned = tiny_drafter(model, counts).train()
    aux, _ = capture_hidden_states(model, seq, torch.ones_like(seq), learned.cfg.aux_layer_ids)
    aux, embed = aux.float().clone(), model.get_input_embeddings().weight.detach().clone()
    n = seq.shape[1] - TTT_STEPS - 1
    pos = torch.arange(n)[None]
    embeds = embed[seq[:, 1 : n + TTT_STEPS]]  # step k at t: token t+1+k
    to_draft = torch.cumsum(learned.t2d.long(), 0) - 1  # target id -> draft id
    start = len(prompts[0]) - 2  # predicting the continuation
    opt = torch.optim.Adam(learned.parameters(), lr=3e-3)
    for _ in range(80):
        hidden = learned.ttt_forward(aux[:, :n], embeds, pos, torch.zeros_like(pos))
        loss = sum(
            F.cross_entropy(learned.logits(h)[0, start:], to_draft[seq[0, 2 + k + start : 2 + k + n]])
            for k, h in enumerate(hidden)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"prompts": prompts, "greedy": greedy, "counts": counts, "drafter": learned.eval()}
