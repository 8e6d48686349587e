"""bench.predict: the training stage's acceptance estimate on the benchmark's prompts and greedy replies, per set,
is the training eval itself on validation rows made from the same data. A tiny random Llama (test_extract's), its
greedy replies to random prompts, and a drafter trained (TrainStep) on one set's rows only (~10 s)."""

import json

import pytest
import torch
from test_extract import tiny_model

from eagle3lib.drafter import Drafter, DrafterConfig, vocab
from eagle3lib.extract.hf import capture_hidden_states
from eagle3lib.params import TrainParams
from eagle3lib.speedup.predict import predict_per_set, predicted_for
from eagle3lib.speedup.replay import greedy_decode
from eagle3lib.train import loop
from eagle3lib.train.runtime.batches import Sequence, make_batch, pack_rows
from eagle3lib.train.ttt_step import TrainStep

AUX = [1, 3, 5]  # test_train's for this 6-layer target (its default [2, 3, 3] is not three layers)
STEPS, MAX_DEPTH = 3, 6


def row_sequences(model, sequences):
    """batches.Sequence of each sequence as build_setup's validation data holds it: states from its own forward,
    loss mask on the reply."""
    out = []
    for s in sequences:
        ids = torch.tensor([s["prompt_ids"] + s["token_ids"]])
        aux, final = capture_hidden_states(model, ids, torch.ones_like(ids), AUX)
        mask = torch.tensor([0] * len(s["prompt_ids"]) + [1] * len(s["token_ids"]), dtype=torch.uint8)
        out.append(Sequence(ids[0], mask, aux[0], final[0]))
    return out


def setup_for(model, drafter, rows):
    return loop.TrainSetup(
        drafter=drafter,
        embed=model.get_input_embeddings().weight.detach().float(),
        head=model.lm_head.weight.detach().float(),
        val_rows=rows,
        contract={},
        out_dir=None,
    )


def training_eval(model, drafter, sequences, packed_len=None):
    """loop.evaluate on the sequences' rows: one a row, or (packed_len) packed by pack_rows as build_setup
    packs validation rows, several documents a row and padding to packed_len."""
    seqs = row_sequences(model, sequences)
    if packed_len:
        rows = [make_batch([r], packed_len) for r in pack_rows(iter(seqs), packed_len)]
    else:
        rows = [make_batch([[q]], len(q.input_ids)) for q in seqs]
    return loop.evaluate(setup_for(model, drafter, rows), STEPS, MAX_DEPTH, "cpu")


@pytest.fixture(scope="module")
def bench():
    """(model, drafter, sequences, per_set): two sets of random prompts of different lengths (they pad each other in
    predict_per_set's batched forward) with the target's greedy replies; the drafter trained on set "code" only."""
    model = tiny_model()
    with torch.no_grad():  # a sharp next-token distribution, as trained models have (test_train's small_target)
        model.lm_head.weight.mul_(40)
    g = torch.Generator().manual_seed(0)
    sequences = []
    for i, (n_prompt, n_reply) in enumerate([(6, 20), (11, 14), (3, 25), (9, 9), (15, 17)]):
        prompt = torch.randint(0, model.config.vocab_size, (n_prompt,), generator=g).tolist()
        reply = greedy_decode(model, prompt, n_reply)
        sequences.append({"id": str(i), "set": "chat" if i % 2 else "code", "prompt_ids": prompt, "token_ids": reply})
    replies = torch.tensor(sum((s["token_ids"] for s in sequences), []))
    counts = vocab.token_counts(replies, torch.ones_like(replies), model.config.vocab_size)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_target(model.config, 64, AUX))
    drafter.set_vocab(*vocab.build_draft_vocab(counts, 64))
    code = [
        make_batch([[q]], len(q.input_ids)) for q in row_sequences(model, [s for s in sequences if s["set"] == "code"])
    ]
    params = TrainParams(ttt_steps=STEPS, dtype="float32", grad_clip=1.0)
    step = TrainStep(setup_for(model, drafter, code), torch.optim.AdamW(drafter.parameters()), params, "cpu", 0, 1)
    for i in range(60):
        step([(0, i, code[i % len(code)])], 3e-3)
    per_set = predict_per_set(model, drafter.eval(), sequences, AUX, MAX_DEPTH, steps=STEPS)
    return model, drafter, sequences, per_set


def test_one_entry_per_set_and_the_counts_add_up(bench):
    _, _, sequences, per_set = bench
    assert list(per_set) == ["chat", "code", "all"]
    assert [per_set[k]["sequences"] for k in per_set] == [2, 3, 5]
    for key in ("positions", "sequences"):
        assert per_set["chat"][key] + per_set["code"][key] == per_set["all"][key]
    # step 0 scores every reply token, the first one too (the draft fed the prompt's last token predicts it)
    assert per_set["all"]["positions"] == sum(len(s["token_ids"]) for s in sequences)
    for summary in per_set.values():
        assert list(summary["accept_len_at"]) == list(range(1, MAX_DEPTH + 1))
        assert summary["trained_steps"] == STEPS and len(summary["cond_acc"]) == STEPS


def test_equals_the_training_eval_on_the_same_rows(bench):
    model, drafter, sequences, per_set = bench
    for name in ("chat", "code", "all"):
        want = training_eval(model, drafter, [s for s in sequences if name in ("all", s["set"])])
        got = per_set[name]
        for key in ("step_acc", "cond_acc", "joint_acc", "est_accept_len", "positions", "extrapolated_depths"):
            assert got[key] == want[key], (name, key)
        assert got["loss_per_step"] == pytest.approx(want["loss_per_step"], rel=1e-5)
    # one sequence a forward (no padding) instead of all in one: the same figures
    alone = predict_per_set(model, drafter, sequences, AUX, MAX_DEPTH, steps=STEPS, batch_tokens=1)
    assert alone["all"]["cond_acc"] == per_set["all"]["cond_acc"]
    # the same rows packed as build_setup packs validation rows: the same figures
    packed = training_eval(model, drafter, sequences, packed_len=64)
    assert (per_set["all"]["cond_acc"], per_set["all"]["positions"]) == (packed["cond_acc"], packed["positions"])
    # the drafter learned the code replies: the estimate says so there, and not on chat
    assert min(per_set["code"]["cond_acc"]) > 0.8 and per_set["chat"]["cond_acc"][0] < 0.5
    assert predicted_for(per_set, "code", 4) > 3 > predicted_for(per_set, "chat", 4)


def test_predicted_for_reads_the_depth_and_survives_json(bench):
    per_set = bench[3]
    assert predicted_for(per_set, "code", 3) == per_set["code"]["accept_len_at"][3]
    assert predicted_for(json.loads(json.dumps(per_set)), "code", 3) == predicted_for(per_set, "code", 3)
    assert predicted_for(per_set, "code", MAX_DEPTH + 1) is None
    assert predicted_for(per_set, "no such set", 3) is None


def test_refuses_an_empty_reply_and_aux_ids_it_cannot_use(bench):
    model, drafter, sequences, _ = bench
    empty = [*sequences, {"id": "e", "set": "chat", "prompt_ids": [1, 2], "token_ids": []}]
    with pytest.raises(ValueError, match="'e' of set 'chat' has an empty reply"):
        predict_per_set(model, drafter, empty, AUX, steps=STEPS)
    with pytest.raises(ValueError, match=r"aux_layer_ids.*found \[2, 4, 9\]"):  # beyond the target's 6 layers
        predict_per_set(model, drafter, sequences, [2, 4, 9], steps=STEPS)
    with pytest.raises(ValueError, match=r"\[1, 2, 3\] are not the drafter's \[1, 3, 5\]"):
        predict_per_set(model, drafter, sequences, [1, 2, 3], steps=STEPS)
    with pytest.raises(ValueError, match="pass steps="):
        predict_per_set(model, drafter, sequences, AUX)
