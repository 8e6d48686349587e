"""Two training levers: train.loss_positions (the loss on every token of a conversation, not only the
assistant's) and train.aux_noise (noise on the target's aux states, drawn from where the micro-batch is in the run,
so that a resumed run draws the same). A tiny random Llama's states (test_predict_sets' helpers), a few TrainSteps."""

import copy

import pytest
import torch
from test_extract import tiny_model
from test_predict_sets import AUX, row_sequences, setup_for

from eagle3lib.drafter import Drafter, DrafterConfig, vocab
from eagle3lib.params import ParamsError, TrainParams, load_params
from eagle3lib.train.runtime.batches import make_batch
from eagle3lib.train.ttt_step import TrainStep, every_token, valid_positions, with_aux_noise

STEPS = 3


@pytest.fixture(scope="module")
def data():
    """(model, drafter, rows): two conversations whose first half is the prompt (loss mask 0), one row each."""
    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    sequences = [
        {"prompt_ids": torch.randint(0, 100, (n,), generator=g).tolist(), "token_ids": list(range(10, 10 + n))}
        for n in (12, 9)
    ]
    rows = [make_batch([[q]], len(q.input_ids)) for q in row_sequences(model, sequences)]
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_target(model.config, 64, AUX))
    ids = torch.cat([r["input_ids"].flatten() for r in rows])
    drafter.set_vocab(*vocab.build_draft_vocab(vocab.token_counts(ids, torch.ones_like(ids), 256), 64))
    return model, drafter, rows


def one_step(model, drafter, rows, params, micro=0):
    """The drafter after one TrainStep on the rows (each a micro-batch), and the step's loss."""
    drafter = copy.deepcopy(drafter)
    step = TrainStep(
        setup_for(model, drafter, rows), torch.optim.SGD(drafter.parameters(), lr=1.0), params, "cpu", 0, 1
    )
    loss, _ = step([(0, micro + i, r) for i, r in enumerate(rows)], 1e-2)
    return drafter, loss


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_every_token_widens_the_loss_to_the_prompt(data):
    _, _, rows = data
    row = rows[0]
    assert row["loss_mask"].sum() < row["loss_mask"].numel()  # the prompt is out of the loss
    widened = every_token(row)
    assert torch.equal(widened["loss_mask"], (row["doc_ids"] >= 0).to(row["loss_mask"].dtype))
    for k in range(STEPS):
        assistant, every = valid_positions(row, k), valid_positions(widened, k)
        assert every.sum() > assistant.sum() and torch.equal(every & assistant, assistant)
    assert row["loss_mask"].sum() < row["loss_mask"].numel()  # the batch itself is left as it was


def test_loss_positions_all_trains_on_the_prompt_too(data):
    model, drafter, rows = data
    assistant, _ = one_step(model, drafter, rows, TrainParams(ttt_steps=STEPS, dtype="float32"))
    every, _ = one_step(model, drafter, rows, TrainParams(ttt_steps=STEPS, dtype="float32", loss_positions="all"))
    assert not same_weights(assistant, every)
    # on rows already all in the loss, the two are one
    full = [every_token(r) for r in rows]
    a, _ = one_step(model, drafter, full, TrainParams(ttt_steps=STEPS, dtype="float32"))
    b, _ = one_step(model, drafter, full, TrainParams(ttt_steps=STEPS, dtype="float32", loss_positions="all"))
    assert same_weights(a, b)


def test_aux_noise_scales_with_each_states_rms():
    torch.manual_seed(0)
    h = 256
    aux = torch.cat([torch.randn(4000, h) * s for s in (0.5, 3.0, 40.0)], -1)  # three layers of unlike scales
    noisy = with_aux_noise(aux, h, 0.1, torch.Generator().manual_seed(1))
    for i, s in enumerate((0.5, 3.0, 40.0)):
        part = slice(i * h, (i + 1) * h)
        assert (noisy[:, part] - aux[:, part]).std().item() == pytest.approx(0.1 * s, rel=0.03)
    again = with_aux_noise(aux, h, 0.1, torch.Generator().manual_seed(1))
    assert torch.equal(noisy, again)


def test_aux_noise_is_drawn_from_the_micro_batchs_place_in_the_run(data):
    model, drafter, rows = data
    plain, _ = one_step(model, drafter, rows, TrainParams(ttt_steps=STEPS, dtype="float32"))
    noisy = TrainParams(ttt_steps=STEPS, dtype="float32", aux_noise=0.2)
    first, loss_first = one_step(model, drafter, rows, noisy)
    resumed, loss_resumed = one_step(model, drafter, rows, noisy)  # the same place: the same noise
    assert same_weights(first, resumed) and torch.equal(loss_first, loss_resumed)
    later, _ = one_step(model, drafter, rows, noisy, micro=5)  # another place: other noise
    assert not same_weights(first, plain) and not same_weights(first, later)


def test_params_refuse_negative_noise_and_unknown_positions(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("run: {name: t}\n")
    with pytest.raises(ParamsError, match="aux_noise"):
        load_params(f, {"train.aux_noise": -0.1})
    with pytest.raises(ParamsError, match="loss_positions"):
        load_params(f, {"train.loss_positions": "user"})
