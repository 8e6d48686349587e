"""TTT training on a small random Llama target with real shards on disk: learning, checkpoints,
resume after kill -9, torchrun data parallel, non-finite loss, online mode, a DeepSeek-V3 (Kimi-shaped) target."""

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from eagle3lib import run_folder, target
from eagle3lib.extract import hf
from eagle3lib.extract.shards import states, store_states
from eagle3lib.params import ParamsError, load_params
from eagle3lib.prepare import conversations
from eagle3lib.train import TrainingError, loop
from eagle3lib.train import notebook as train_notebook
from eagle3lib.train.runtime import launch
from eagle3lib.train.runtime.batches import Sequence, batch_states, in_background, make_batch, pack_rows
from eagle3lib.train.runtime.checkpoint import latest_checkpoint, load_drafter
from eagle3lib.train.runtime.setup import build_setup
from eagle3lib.train.sources import online
from eagle3lib.train.sources.base import CAPTURE_SUMMARY

AUX = [1, 3, 5]
ROOT = Path(__file__).resolve().parents[2]


def random_tokens(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 90, (n,), generator=g).tolist()
    ids = torch.randint(0, vocab, (sum(lengths),), generator=g, dtype=torch.int32)
    mask = torch.zeros(sum(lengths), dtype=torch.uint8)
    starts = [0]
    for n_tok in lengths:
        mask[starts[-1] + n_tok // 3 : starts[-1] + n_tok] = 1  # the "assistant" part
        starts.append(starts[-1] + n_tok)
    return {"input_ids": ids, "loss_mask": mask, "seq_starts": torch.tensor(starts), "ids": [str(i) for i in range(n)]}


def make_run(
    root: Path, model, tokenizer, train_params: dict, n_train=40, store_dtype=torch.float32, batch_tokens=1024
) -> Path:
    """A run folder whose 00_prepare and 01_extract were made by the library from a real (random) target; its
    params' extract section says how (online mode captures with the same batch_tokens and orders as shards)."""
    tdir = root / "target"
    if not tdir.exists():
        model.save_pretrained(tdir)
        tokenizer.save_pretrained(tdir)
    run_dir = root / "outputs" / "t"
    prep = run_dir / "00_prepare"
    contract = target.make_contract(str(tdir), model, tokenizer, AUX, "float32")
    for split, n, seed in (("train", n_train, 1), ("val", 8, 2)):
        tokens = random_tokens(n, model.config.vocab_size, seed)
        conversations.save_tokens(prep / f"{split}.safetensors", tokens)
        hf.extract(
            model,
            tokens,
            AUX,
            run_dir / "01_extract" / split,
            contract,
            batch_tokens=batch_tokens,
            shard_max_tokens=700,
            store_dtype=store_dtype,
            progress=False,
        )
    target.write_contract(prep, contract)
    run_folder.save_result(run_dir, "00_prepare", {})
    run_folder.save_result(run_dir, "01_extract", {})
    train_section = {
        "ttt_steps": 3,
        "max_seq_len": 128,
        "draft_vocab_size": 96,
        "max_tokens": 128 * 12,
        "lr": 3e-3,
        "warmup_steps": 2,
        "checkpoint_every": 4,
        "eval_every": 4,
        "eval_max_tokens": 2000,
    } | train_params
    (root / "params.yaml").write_text(
        json.dumps(
            {
                "run": {"name": "t", "output_root": "outputs", "seed": 0},
                "target": {"name": str(tdir), "dtype": "float32", "num_layers": 6, "aux_layer_ids": AUX},
                "extract": {"batch_tokens": batch_tokens, "shard_max_tokens": 700},
                "train": train_section,
                "bench": {"depths": [5]},
            }
        )
    )
    return run_dir


def params_file(root):
    return str(root / "params.yaml")


def state(folder):
    return load_drafter(folder).state_dict()


def test_training_learns_and_writes_the_canonical_checkpoint(tmp_path, small_target):
    run_dir = make_run(tmp_path, *small_target, {"max_tokens": 128 * 40, "eval_every": 40})
    p = load_params(params_file(tmp_path))
    setup, vocab_stats = build_setup(p, run_dir)
    before = loop.evaluate(setup, 3, 5, "cpu")
    console = []
    summary = loop.train(setup, p.train, log=console.append)
    after = summary["eval"]
    assert after["loss_per_step"][0] < 0.8 * before["loss_per_step"][0]
    # each evaluation's line carries the rate so far: a stage stopped before its summary still shows it
    assert re.fullmatch(r"step 40/40 loss [\d.]+ est_accept_len@5 [\d.]+ cond_acc \[.*\] [\d,]+ tokens/s", console[-1])
    assert after["step_acc"][0] > before["step_acc"][0]
    assert 0 <= summary["data_wait_s"] <= summary["train_seconds"]  # shards prefetched: p.train.prefetch_shards
    folder = run_dir / "02_train" / "drafter"
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 96
    contract = json.loads((folder / "eagle3.json").read_text())
    assert contract["draft_vocab_size"] == 96 and len(contract["d2t_sha256"]) == 64
    assert contract["aux_layer_ids"] == AUX
    loaded = state(folder)
    assert all(torch.equal(loaded[k], v) for k, v in setup.drafter.state_dict().items())
    log = [json.loads(line) for line in (run_dir / "02_train" / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log if "eval" not in e] == list(range(1, 41))
    assert 0 < vocab_stats["val_coverage"] <= 1


def test_rerun_with_other_params_trains_anew_and_sets_the_old_run_aside(tmp_path, small_target, capsys):
    """A finished run rerun with another train.lr (or draft vocabulary) must not hand back the old drafter
    from its final checkpoint: it trains from step 0, and the old checkpoints are kept aside."""
    run_dir = make_run(tmp_path, *small_target, {})
    drafter = run_dir / "02_train" / "drafter" / "model.safetensors"
    launch.run_stage(load_params(params_file(tmp_path)), str(run_dir))
    first = drafter.read_bytes()
    launch.run_stage(load_params(params_file(tmp_path)), str(run_dir))  # same params: resumes at the end, same weights
    assert drafter.read_bytes() == first and "resumed from" in capsys.readouterr().out
    summary = launch.run_stage(load_params(params_file(tmp_path), {"train.lr": 0.0031}), str(run_dir))
    out = capsys.readouterr().out
    assert "not resuming" in out and "train.lr: 0.003 -> 0.0031" in out
    assert drafter.read_bytes() != first and summary["steps"] == 12
    entries = [json.loads(line) for line in (run_dir / "02_train" / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in entries if "eval" not in e] == list(range(1, 13))
    assert latest_checkpoint(run_dir / "02_train" / "checkpoints.previous") is not None
    # A shape change trains anew too, instead of failing inside load_state_dict.
    launch.run_stage(
        load_params(params_file(tmp_path), {"train.lr": 0.0031, "train.draft_vocab_size": 64}), str(run_dir)
    )
    assert "train.draft_vocab_size: 96 -> 64" in capsys.readouterr().out
    assert load_drafter(run_dir / "02_train" / "drafter").cfg.draft_vocab_size == 64


def test_a_time_budget_sizes_the_schedule_so_that_it_anneals_and_a_resume_keeps_it(tmp_path, small_target):
    """train.max_minutes ending long before train.max_tokens: the cosine is sized to the minutes once the step
    rate is known, so the learning rate falls to its floor within the budget (sized to the tokens it would stay near
    the peak), and the decision resumes with the run."""
    many = {"max_tokens": 128 * 100_000, "max_minutes": 0.1, "eval_every": 50, "checkpoint_every": 50}
    run_dir = make_run(tmp_path, *small_target, many)
    p = load_params(params_file(tmp_path))
    lines = []
    summary = loop.train(build_setup(p, run_dir)[0], p.train, log=lines.append)
    made = summary["schedule"]
    assert made["token_steps"] == 100_000 and made["budget_s"] == 6.0 and made["decided_at"] == 11
    assert "train.max_minutes" in made["why"] and made["why"] in lines
    assert 11 < summary["total_steps"] == made["total_steps"] < 100_000 and summary["steps"] <= summary["total_steps"]
    # revised at the first evaluation in the loop, where the run got that far
    assert made.get("revised_at") == (50 if summary["steps"] >= 50 else None)
    log = [json.loads(line) for line in (run_dir / "02_train" / "log.jsonl").read_text().splitlines()]
    lrs = [e["lr"] for e in log if "lr" in e]
    assert min(lrs) < 0.5 * p.train.lr and lrs[-1] == min(lrs)  # annealing, and still falling at the end
    again = loop.train(build_setup(p, run_dir)[0], p.train, log=lambda *a: None)
    assert again["schedule"] == made and again["total_steps"] == summary["total_steps"]


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, small_target):
    run_dir = make_run(tmp_path, *small_target, {"max_tokens": 128 * 4})
    p = load_params(params_file(tmp_path))
    setup, _ = build_setup(p, run_dir)
    loop.train(setup, p.train, log=lambda *a: None)
    good = run_dir / "02_train" / "checkpoints" / "step_0000004"
    before = (good / "model.safetensors").read_bytes()
    p = load_params(params_file(tmp_path), {"train.max_tokens": 128 * 12})
    setup, _ = build_setup(p, run_dir)
    setup.head[5] = float("nan")  # a corrupt target head: every target distribution turns nan
    with pytest.raises(TrainingError, match=r"loss became nan at step 4.*step_0000004.*train.lr"):
        loop.train(setup, p.train, log=lambda *a: None)
    assert (good / "model.safetensors").read_bytes() == before
    assert latest_checkpoint(run_dir / "02_train" / "checkpoints") == good


def test_online_and_shards_train_the_same_drafter(tmp_path, small_target):
    """Online mode trains on the rows shards give, in the same order. Extracted and captured one sequence per
    forward (batch_tokens 1: the same unpadded forward), the states are the same bits and so is the drafter.
    Captured in padded groups (batch_tokens 1024), the target's matmuls run other shapes and round differently
    (~1e-7 relative in fp32); AdamW's first steps move a weight by about lr whatever its gradient's size, so a
    near-zero gradient whose sign the rounding flips moves it differently: the tolerance is a third of one step
    (1e-3 at lr 3e-3; measured 6e-4 after 12 steps)."""
    run_dir = make_run(tmp_path, *small_target, {}, batch_tokens=1)
    drafter = run_dir / "02_train" / "drafter" / "model.safetensors"
    shards = launch.run_stage(load_params(params_file(tmp_path)), str(run_dir))
    offline = drafter.read_bytes()
    online = launch.run_stage(load_params(params_file(tmp_path), {"train.source": "online"}), str(run_dir))
    assert drafter.read_bytes() == offline
    assert online["steps"] == shards["steps"] == 12 and online["tokens"] == shards["tokens"]
    assert online["eval"]["loss_per_step"] == pytest.approx(shards["eval"]["loss_per_step"], rel=1e-6)
    assert online["online"]["started_at"] == {"epoch": 0, "sequence": 0} and online["online"]["tokens"] > 0
    batched_online = {"train.source": "online", "extract.batch_tokens": 1024, "train.resume": False}
    launch.run_stage(load_params(params_file(tmp_path), batched_online), str(run_dir))
    batched, ref = state(run_dir / "02_train" / "drafter"), load_file_state(offline)
    assert any(not torch.equal(batched[k], ref[k]) for k in ref), "padded groups were expected to round differently"
    worst = max((batched[k].float() - ref[k].float()).abs().max().item() for k in ref)
    assert worst < 1e-3, f"largest weight difference, padded groups against one sequence a forward: {worst}"


def load_file_state(data: bytes) -> dict:
    from safetensors.torch import load

    return load(data)


def test_online_run_writes_no_states_and_a_bad_option_is_refused(tmp_path, small_target):
    run_dir = make_run(tmp_path, *small_target, {"source": "online", "max_tokens": 128 * 4})
    shutil.rmtree(run_dir / "01_extract")
    before = folder_bytes(tmp_path)
    summary = launch.run_stage(load_params(params_file(tmp_path)), str(run_dir))
    assert summary["steps"] == 4
    written = {p.relative_to(run_dir / "02_train").parts[0] for p in (run_dir / "02_train").rglob("*") if p.is_file()}
    assert written == {"checkpoints", "drafter", "log.jsonl", "train_summary.json"}
    # the checkpoints and the drafter: a few times the drafter's weights, no states (40 sequences x ~55 tokens x
    # 4 states of 64 fp32 would be ~2.2 MB on their own)
    drafter_bytes = (run_dir / "02_train" / "drafter" / "model.safetensors").stat().st_size
    assert folder_bytes(tmp_path) - before < 10 * drafter_bytes
    with pytest.raises(ParamsError, match="train.online_cache_first_epoch only apply to train.source: online"):
        load_params(params_file(tmp_path), {"train.source": "shards", "train.online_cache_first_epoch": True})


def assert_capture_summary_and_drafter_as(run: Path, summary: dict, reference: Path) -> None:
    """A run whose capture ran apart (a process or a Ray actor): it captured from the start at least what it
    trained, and its drafter is the reference run's, byte for byte."""
    capture = json.loads((run / "02_train" / CAPTURE_SUMMARY).read_text())
    assert capture["started_at"] == {"epoch": 0, "sequence": 0} and capture["tokens"] >= summary["tokens"]
    a, b = state(reference / "02_train" / "drafter"), state(run / "02_train" / "drafter")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_online_cache_first_epoch_writes_the_extraction_and_later_epochs_read_it(tmp_path, small_target):
    """online_cache_first_epoch: epoch 0's states become the shards 01_extract writes (the same bytes, one sequence a
    forward in fp32), later epochs read them, and the drafter is the shards run's. A run resumed within epoch 0
    misses the shard it stopped in: reading epoch 1 finishes the cache first."""
    run_dir = make_run(tmp_path, *small_target, {"max_tokens": 128 * 40, "eval_every": 100}, batch_tokens=1)
    drafter = run_dir / "02_train" / "drafter" / "model.safetensors"
    launch.run_stage(load_params(params_file(tmp_path)), str(run_dir))
    offline = drafter.read_bytes()
    cached = {"train.source": "online", "train.online_cache_first_epoch": True, "extract.store_dtype": "float32"}
    s = launch.run_stage(load_params(params_file(tmp_path), cached), str(run_dir))
    assert drafter.read_bytes() == offline
    cache = run_dir / "02_train" / online.CACHE_DIR
    extracted = json.loads((run_dir / "01_extract" / "train" / "manifest.json").read_text())
    assert json.loads((cache / "manifest.json").read_text())["shards"] == extracted["shards"]
    # trained ~1.8 epochs; captured epoch 0 only (and the queue's look-ahead), epoch 1 read from the cache
    assert s["tokens"] > extracted["num_tokens"] and s["online"]["sequences"] == extracted["num_sequences"]
    # a resume within epoch 0, at sequence 7 of its order: sequences 0-6's shard is never captured in epoch 0
    shutil.rmtree(cache)
    p = load_params(params_file(tmp_path), cached)
    train_tokens = conversations.load_tokens(run_dir / "00_prepare" / "train.safetensors")
    data, _, _ = online.capture_setup(p, train_tokens, train_tokens, run_dir / "02_train")
    assert sum(1 for _ in data.train_sequences(0, 7)) == 40 - 7
    assert len(json.loads((cache / "manifest.json").read_text())["shards"]) == len(extracted["shards"]) - 1
    next(iter(data.train_sequences(1, 0)))
    assert json.loads((cache / "manifest.json").read_text())["shards"] == extracted["shards"]


class EngineStandIn:
    """SGLang's model runner as EngineStates drives it (extend: consecutive sequences in one ragged batch, their
    states in token order), computed by the hf target one unpadded forward a sequence: the real one needs a GPU
    (python -m benchmarks online runs it there)."""

    def __init__(self, model):
        self.model, self.batches, self.closed = model, [], False

    def extend(self, seqs, capture):
        self.batches.append([len(q) for q in seqs])
        rows = [hf.capture_hidden_states(self.model, torch.tensor([q]), torch.ones(1, len(q)), AUX) for q in seqs]
        return torch.cat([a[0] for a, _ in rows]), torch.cat([f[0] for _, f in rows])

    def close(self):
        self.closed = True


def test_online_through_sglang_inprocess_states_trains_the_shards_drafter(tmp_path, small_target):
    """extract.backend sglang_inprocess online: EngineStates packs consecutive sequences up to batch_tokens real
    tokens (no padding) into one extend, splits the states back per sequence and hands them to the trainer; with
    the same states per sequence, the drafter is the shards run's, byte for byte. A capture handed to the stage
    is the caller's: the stage leaves it open."""
    from eagle3lib.extract.sglang_inprocess import EngineStates

    model, tokenizer = small_target
    run_dir = make_run(tmp_path, model, tokenizer, {}, batch_tokens=1)
    drafter = run_dir / "02_train" / "drafter" / "model.safetensors"
    launch.run_stage(load_params(params_file(tmp_path)), str(run_dir))
    offline = drafter.read_bytes()
    p = load_params(params_file(tmp_path), {"train.source": "online"})
    engine = EngineStandIn(model)
    loaded = (EngineStates(engine, 300), online.capture_contract(p, model, tokenizer))
    s = launch.run_stage(load_params(params_file(tmp_path), {"train.source": "online"}), str(run_dir), handed=loaded)
    assert drafter.read_bytes() == offline and s["online"]["tokens"] > 0
    assert max(sum(b) for b in engine.batches) <= 300 and max(len(b) for b in engine.batches) > 3  # ragged groups
    assert not engine.closed


def folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_fp8_shards_train_as_bf16_shards_do(tmp_path, small_target):
    """The same run on bf16 shards (the format every earlier run wrote, no scales) and on fp8 shards: both train,
    the fp8 batches dequantize on the device, and the losses stay close."""
    runs = {}
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        root = tmp_path / str(dtype).removeprefix("torch.")
        run_dir = make_run(root, *small_target, {"max_tokens": 128 * 8, "eval_every": 8}, store_dtype=dtype)
        p = load_params(params_file(root))
        setup, _ = build_setup(p, run_dir)
        before = loop.evaluate(setup, 3, 3, "cpu")
        runs[dtype] = (before, loop.train(setup, p.train, log=lambda *a: None))
    (b_bf16, s_bf16), (b_fp8, s_fp8) = runs.values()
    assert s_bf16["steps"] == s_fp8["steps"] == 8
    assert b_fp8["loss_per_step"] == pytest.approx(b_bf16["loss_per_step"], rel=0.02)
    assert s_fp8["eval"]["loss_per_step"] == pytest.approx(s_bf16["eval"]["loss_per_step"], rel=0.05)


def test_fp8_batches_carry_scales_and_dequantize_as_the_shards_read():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 4 * 8, generator=g) * torch.logspace(-2, 2, 7)[:, None]
    stored = store_states(x[:, :24], x[:, 24:], 3, torch.float8_e4m3fn)
    seq = Sequence(
        torch.arange(7),
        torch.ones(7, dtype=torch.uint8),
        stored["aux_hidden"],
        stored["final_hidden"],
        stored["aux_scale"],
        stored["final_scale"],
    )
    b = make_batch(list(pack_rows(iter([seq]), 9)), 9)
    assert b["aux"].dtype == torch.float8_e4m3fn and b["aux_scale"].shape == (1, 9, 3)
    aux, final = batch_states(b, torch.float32)
    want_aux, want_final = states(stored, dtype=torch.float32)
    assert torch.equal(aux[0, :7], want_aux) and torch.equal(final[0, :7], want_final)
    assert (aux[0, 7:] == 0).all() and (final[0, 7:] == 0).all()
    torch.testing.assert_close(aux[0, :7], x[:, :24], rtol=2**-4, atol=0)


def test_deepseek_v3_shaped_target_extracts_and_trains(tmp_path, embedded_cache):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=6,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        tie_word_embeddings=False,
    )
    model = DeepseekV3ForCausalLM(cfg).eval()
    tokenizer = AutoTokenizer.from_pretrained(embedded_cache[1])
    ids = torch.randint(0, 256, (1, 30))
    aux, final = hf.capture_hidden_states(model, ids, torch.ones_like(ids), AUX)
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
        assert torch.allclose(model.lm_head(final.clone()), ref.logits, atol=1e-5)
    assert torch.equal(aux[0, :, :64], ref.hidden_states[1][0])
    run_dir = make_run(tmp_path, model, tokenizer, {"max_tokens": 128 * 3, "eval_every": 3})
    summary = launch.run_stage(load_params(params_file(tmp_path)), str(run_dir))
    assert summary["steps"] == 3 and torch.isfinite(torch.tensor(summary["eval"]["loss_per_step"])).all()


def test_make_batch_lays_out_packed_rows_with_padding_at_the_end():
    def seq(n, start):
        ids = torch.arange(start, start + n, dtype=torch.int32)
        return Sequence(
            ids,
            (ids % 2).to(torch.uint8),
            ids[:, None].repeat(1, 6).to(torch.bfloat16),
            -ids[:, None].repeat(1, 2).to(torch.bfloat16),
        )

    rows = list(pack_rows(iter([seq(3, 10), seq(4, 20), seq(9, 30), seq(2, 50)]), 8))
    assert [[len(s.input_ids) for s in r] for r in rows] == [[3, 4], [8], [2]]  # greedy, truncated to 8
    b = make_batch(rows[:2], 8)
    assert b["tokens"] == 15
    assert b["input_ids"].tolist() == [[10, 11, 12, 20, 21, 22, 23, 0], list(range(30, 38))]
    assert b["doc_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, -1], [0] * 8]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], list(range(8))]
    assert b["loss_mask"].tolist() == [[0, 1, 0, 0, 1, 0, 1, 0], [0, 1] * 4]
    assert b["aux"].shape == (2, 8, 6) and b["aux"][0, :7, 0].tolist() == [10, 11, 12, 20, 21, 22, 23]
    assert (b["aux"][0, 7] == 0).all() and (b["final"][0, 7] == 0).all() and b["final"][1, 2, 1] == -32
    assert b["input_ids"].dtype == torch.long and b["aux"].dtype == torch.bfloat16


def test_in_background_keeps_order_raises_where_the_source_did_and_stops_on_close():
    assert list(in_background(iter(range(50)), 3)) == list(range(50))

    def failing():
        yield from range(5)
        raise ValueError("shard 5 is corrupt")

    got = []
    with pytest.raises(ValueError, match="shard 5"):
        for x in in_background(failing(), 2):
            got.append(x)
    assert got == list(range(5))

    closed = []

    def endless():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.append(True)

    stream = in_background(endless(), 2)
    assert [next(stream) for _ in range(10)] == list(range(10))
    stream.close()
    assert closed == [True]  # the source was closed in its thread, and that thread has ended


def test_init_layer_from_target_and_the_recipe_levers_script(tmp_path, small_target):
    """train.init_layer_from_target reaches the drafter through build_setup; benchmarks/recipe_levers.py trains
    each lever from scratch on the same run and reports its tokens and acceptance, leaving the run untouched."""
    import importlib.util

    run_dir = make_run(tmp_path, *small_target, {"max_tokens": 128 * 4, "eval_every": 4})
    model = small_target[0]
    p = load_params(params_file(tmp_path), {"train.init_layer_from_target": True})
    setup, _ = build_setup(p, run_dir)
    last = model.model.layers[-1]
    h = model.config.hidden_size
    assert torch.equal(setup.drafter.layer.mlp.down_proj.weight, last.mlp.down_proj.weight)
    assert torch.equal(setup.drafter.layer.self_attn.q_proj.weight[:, h:], last.self_attn.q_proj.weight)
    assert not setup.drafter.layer.self_attn.q_proj.weight[:, :h].any()
    assert torch.equal(setup.drafter.fc.weight[:, 2 * h :], torch.eye(h))

    spec = importlib.util.spec_from_file_location(
        "recipe_levers", ROOT / "benchmarks" / "questions" / "recipe_levers.py"
    )
    levers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(levers)
    assert levers.parse_lever("ttt3:train.ttt_steps=3,train.lr=2e-3") == (
        "ttt3",
        {"train.ttt_steps": 3, "train.lr": 2e-3},
    )
    assert levers.parse_lever("n:train.eagle31_norms=[norm_before_fc,norm_output],train.lr=1e-3") == (
        "n",
        {"train.eagle31_norms": ["norm_before_fc", "norm_output"], "train.lr": 1e-3},
    )
    rows = [
        levers.run_lever(params_file(tmp_path), run_dir, 1.0, name, overrides, seed=0, tokens=128 * 4)
        for name, overrides in (("default", {}), ("init", {"train.init_layer_from_target": True}))
    ]
    assert 0 < rows[0]["tokens"] == rows[1]["tokens"] <= 128 * 4  # same stream, same steps; rows may be short
    for r in rows:
        assert set(r["est_accept_len"]) == {"1", "2", "3", "5"}
        assert 1.0 <= r["est_accept_len"]["3"] <= 4.0
    assert rows[0]["cond_acc"] != rows[1]["cond_acc"]
    assert not (run_dir / "02_train" / "drafter").exists()  # levers train in scratch folders


def test_init_from_warm_starts_from_each_layout_and_refuses_what_does_not_fit(tmp_path, small_target):
    """train.init_from reads our checkpoint, its speculators export and its SGLang (EAGLE/SpecForge midlayer.*)
    export back into the run's drafter, vocabulary included; another target, other aux layers or another draft
    vocabulary size are refused, naming both sides."""
    from eagle3lib.convert import layouts
    from eagle3lib.drafter.vocab import build_draft_vocab, d2t_sha256
    from eagle3lib.train.runtime.checkpoint import save_drafter

    run_dir = make_run(tmp_path, *small_target, {"max_tokens": 128 * 4, "eval_every": 4})
    p = load_params(params_file(tmp_path))
    setup, _ = build_setup(p, run_dir)
    donor = setup.drafter
    torch.manual_seed(7)
    with torch.no_grad():
        for param in donor.parameters():
            param.add_(torch.randn_like(param))
    donor.set_vocab(*build_draft_vocab(torch.arange(256).flip(0).float(), 96))  # not the run's own vocabulary
    donor_contract = setup.contract | {"d2t_sha256": d2t_sha256(donor.d2t)}
    ours = save_drafter(donor, tmp_path / "donor" / "ours", donor_contract)
    folders = {"ours": ours} | {
        e: layouts.export(ours, e, tmp_path / "donor" / e, target=str(tmp_path / "target"))
        for e in ("speculators", "sglang")
    }
    want = donor.state_dict()
    for name, folder in folders.items():
        warm, stats = build_setup(load_params(params_file(tmp_path), {"train.init_from": str(folder)}), run_dir)
        got = warm.drafter.state_dict()
        assert all(torch.equal(got[k], want[k].to(got[k].dtype)) for k in want), name
        assert (
            stats["warm_start"]["layout"]
            == {"ours": "canonical", "speculators": "speculators", "sglang": "specforge"}[name]
        )
        assert warm.contract["d2t_sha256"] != setup.contract["d2t_sha256"]  # the donor's vocabulary came along
        assert 0 < stats["val_coverage"] <= 1

    def refused(folder, contract_change: dict, match: str, aux=None):
        import copy

        other = copy.deepcopy(donor)
        other.cfg.aux_layer_ids = aux or other.cfg.aux_layer_ids
        save_drafter(other, folder, donor_contract | contract_change | ({"aux_layer_ids": aux} if aux else {}))
        with pytest.raises(TrainingError, match=match):
            build_setup(load_params(params_file(tmp_path), {"train.init_from": str(folder)}), run_dir)

    foreign = {"target": "other/model", "target_fingerprint": "f" * 16}
    refused(tmp_path / "f1", foreign, r"trained for target 'other/model' .*this run's target is '")
    refused(
        tmp_path / "f2",
        {},
        r"reads target layers \[1, 2, 3\], this run's hidden states are of layers \[1, 3, 5\]",
        [1, 2, 3],
    )
    small = load_params(params_file(tmp_path), {"train.draft_vocab_size": 64, "train.init_from": str(ours)})
    with pytest.raises(TrainingError, match=r"lm_head.weight is \(96, 64\) there, \(64, 64\) here"):
        build_setup(small, run_dir)
    with pytest.raises(TrainingError, match="no config.json"):
        build_setup(load_params(params_file(tmp_path), {"train.init_from": str(tmp_path)}), run_dir)
    normed = load_params(params_file(tmp_path), {"train.eagle31_norms": ["norm_output"], "train.init_from": str(ours)})
    with pytest.raises(TrainingError, match=r"EAGLE-3.1 norms are none, this run's .*\['norm_output'\]"):
        build_setup(normed, run_dir)


def test_eagle31_norms_train_and_reach_the_checkpoint(tmp_path, small_target):
    """train.eagle31_norms builds the drafter with speculators' default norms: it learns, its checkpoint carries
    the flags and their weights and loads back as the same drafter; exclusive flags are refused by name."""
    norms = ["norm_before_fc", "norm_output", "norm_before_residual"]
    run_dir = make_run(tmp_path, *small_target, {"max_tokens": 128 * 20, "eval_every": 20, "eagle31_norms": norms})
    p = load_params(params_file(tmp_path))
    setup, _ = build_setup(p, run_dir)
    assert setup.drafter.cfg.variants == dict.fromkeys(norms, True)
    before = loop.evaluate(setup, 3, 5, "cpu")
    summary = loop.train(setup, p.train, log=lambda *a: None)
    assert summary["eval"]["loss_per_step"][0] < 0.9 * before["loss_per_step"][0]
    folder = run_dir / "02_train" / "drafter"
    assert all(json.loads((folder / "config.json").read_text())[n] is True for n in norms)
    loaded = state(folder)
    assert "input_norm.weight" in loaded
    assert all(torch.equal(loaded[k], v) for k, v in setup.drafter.state_dict().items())
    both = load_params(params_file(tmp_path), {"train.eagle31_norms": ["norm_before_fc", "fc_norm"]})
    with pytest.raises(TrainingError, match="train.eagle31_norms: norm_before_fc and fc_norm are exclusive"):
        build_setup(both, run_dir)


def test_muon_trains_the_matrices_and_its_state_resumes(tmp_path, small_target):
    """train.optimizer muon: Muon takes the layer's and fc's matrices, AdamW the draft head and the norms; the
    drafter learns; the two optimizers' state round-trips through state_dict, so a resumed step equals the
    uninterrupted one."""
    from eagle3lib.train.runtime.optimizer import make_optimizer, split_for_muon

    run_dir = make_run(tmp_path, *small_target, {"max_tokens": 128 * 20, "eval_every": 20, "optimizer": "muon"})
    p = load_params(params_file(tmp_path))
    setup, _ = build_setup(p, run_dir)
    names = {id(v): k for k, v in setup.drafter.named_parameters()}
    muon, adamw = split_for_muon(setup.drafter)
    assert {names[id(t)] for t in muon} >= {
        "fc.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.mlp.down_proj.weight",
    }
    assert {"lm_head.weight", "norm.weight"} <= {names[id(t)] for t in adamw}
    assert all(t.ndim == 2 for t in muon) and not any("lm_head" in names[id(t)] for t in muon)
    before = loop.evaluate(setup, 3, 5, "cpu")
    summary = loop.train(setup, p.train, log=lambda *a: None)
    assert summary["eval"]["loss_per_step"][0] < 0.9 * before["loss_per_step"][0]

    def one_step(opt, model, seed):
        torch.manual_seed(seed)
        for t in model.parameters():
            t.grad = torch.randn_like(t) if t.requires_grad else None
        opt.step()

    a, b = setup.drafter, load_drafter(run_dir / "02_train" / "drafter")
    opt_a = make_optimizer(a, "muon", 1e-2, 0.1, "cpu")
    one_step(opt_a, a, 0)
    opt_b = make_optimizer(b, "muon", 1e-2, 0.1, "cpu")
    b.load_state_dict(a.state_dict())
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as through optimizer.pt: no shared state tensors
    one_step(opt_a, a, 1)
    one_step(opt_b, b, 1)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    with pytest.raises(ValueError, match="expected a Muon\\+AdamW optimizer state"):
        opt_b.load_state_dict(torch.optim.AdamW(a.parameters()).state_dict())


def test_sglang_inprocess_online_in_a_capture_process_takes_its_tp_gpus_first_and_the_trainers_the_next(
    tmp_path, monkeypatch
):
    """extract.backend sglang_inprocess online with online_placement: process: the capture process (SGLang's
    interpreter) takes the first --tp GPUs, the trainers one each after them (each side sees its own first), and
    fewer GPUs than both sides need make them share the first ones (the states through host memory: NCCL makes no
    communicator of two processes on one GPU), and fewer than either side needs are refused at the launch, saying
    how many; the hf capture takes one. The link's data group is NCCL only where both torch builds carry the same
    NCCL and the sides have GPUs of their own (else gloo, through host memory)."""
    from eagle3lib.engines.sglang import tp_size
    from eagle3lib.train import sources
    from eagle3lib.train.sources.capture_link import data_backend
    from eagle3lib.train.sources.process import CaptureProcess, InEngineProcess

    params = tmp_path / "p.yaml"
    params.write_text("run: {name: t}\n")
    online_gpus = {"train.source": "online", "train.online_placement": "process", "target.device": "cuda"}
    sglang = {"extract.backend": "sglang_inprocess", "engine.name": "sglang", "engine.extra_args": ["--tp", "2"]}
    p = load_params(params, online_gpus | sglang | {"train.nproc_per_node": 2})
    placement = sources.for_params(p)
    assert isinstance(placement, InEngineProcess)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    # each side's own GPUs first, the other's after them (visible: NCCL reaches them peer to peer)
    assert placement.split_gpus(p) == ({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, {"CUDA_VISIBLE_DEVICES": "6,7,4,5"})
    assert "on cuda:0..1, 2 trainer(s) on cuda:2..3" in placement.device_split(p)[0]
    assert not placement.gpu_layout(p).shared
    three = load_params(params, online_gpus | sglang | {"train.nproc_per_node": 3})  # 2 + 3 on 4 GPUs: shared
    assert placement.split_gpus(three) == ({"CUDA_VISIBLE_DEVICES": "4,5,6,7"},) * 2
    assert placement.gpu_layout(three).shared and placement.device_split(three)[1]
    assert "trainer(s) on cuda:0..2, sharing them (states through host memory)" in placement.device_split(three)[0]
    with pytest.raises(TrainingError, match="5 GPUs, and 4 are visible"):
        placement.split_gpus(load_params(params, online_gpus | sglang | {"train.nproc_per_node": 5}))
    hf = load_params(params, online_gpus | {"train.nproc_per_node": 3})
    assert type(sources.for_params(hf)) is CaptureProcess
    split = sources.for_params(hf).split_gpus(hf)
    assert split == ({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, {"CUDA_VISIBLE_DEVICES": "5,6,7,4"})
    flags = ([], ["--tp-size=8"], ["--tensor-parallel-size", "2", "--tp", "4"], ["--tp"])
    assert [tp_size(f) for f in flags] == [1, 8, 4, 1]  # the last one wins, as argparse reads them
    assert data_backend("cuda:1", {"nccl": "2.27.3"}, {"nccl": "2.27.3"}) == "nccl"
    assert data_backend("cuda", {"nccl": "2.27.3"}, {"nccl": "2.28.9"}) == "gloo"
    assert data_backend("cpu", {"nccl": None}, {"nccl": None}) == "gloo"
    assert data_backend("cuda:0", {"nccl": "2.27.3"}, {"nccl": "2.27.3"}, through_host=True) == "gloo"
    # one GPU (an H200, say): the hf capture process and one trainer share it, through the host
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    one = load_params(params, online_gpus)
    assert sources.for_params(one).split_gpus(one) == ({"CUDA_VISIBLE_DEVICES": "3"},) * 2
    assert sources.for_params(one).device_split(one) == (
        "the capture process and 1 trainer(s) share cuda:0 (states through host memory)",
        True,
    )


def test_ray_placement_gives_the_sglang_capture_its_tp_gpus_and_shares_one_gpu_with_one_trainer(tmp_path, monkeypatch):
    """online_placement: ray: the capture actor's bundle holds SGLang's --tp GPUs (one node's) with
    extract.backend sglang_inprocess, one GPU with hf, and each trainer's one; on a cluster of one GPU, a one-GPU
    capture and one trainer take half of it each (Ray's fractional GPUs), and the plan says they take turns.
    (Ray itself is not needed to choose the bundles.)"""
    from eagle3lib.train import sources
    from eagle3lib.train.sources.ray_actors import InEngineRay, RayActors

    params = tmp_path / "p.yaml"
    params.write_text("run: {name: t}\n")
    ray_gpus = {"train.source": "online", "train.online_placement": "ray", "target.device": "cuda"}
    sglang = {"extract.backend": "sglang_inprocess", "engine.name": "sglang", "engine.extra_args": ["--tp", "8"]}
    kimi = load_params(params, ray_gpus | sglang | {"train.nproc_per_node": 4})
    placement = sources.for_params(kimi)
    assert type(placement) is InEngineRay
    node = {"CPU": 1, "GPU": 8}
    assert placement.bundles(kimi, {"GPU": 16}) == [node] + [{"CPU": 1, "GPU": 1}] * 4
    assert placement.bundles(kimi, {"GPU": 1}) == [node] + [{"CPU": 1, "GPU": 1}] * 4  # place() refuses it
    one = load_params(params, ray_gpus | sglang | {"engine.extra_args": []})
    assert sources.for_params(one).bundles(one, {"GPU": 1}) == [{"CPU": 1, "GPU": 0.5}] * 2
    assert sources.for_params(one).bundles(one, {"GPU": 2}) == [{"CPU": 1, "GPU": 1}] * 2
    hf = load_params(params, ray_gpus | {"train.nproc_per_node": 2})
    assert type(sources.for_params(hf)) is RayActors
    assert sources.for_params(hf).bundles(hf, {"GPU": 1}) == [{"CPU": 1, "GPU": 1}] * 3  # two trainers: no share
    cpu = load_params(params, ray_gpus | {"target.device": "cpu"})
    assert sources.for_params(cpu).bundles(cpu, {"CPU": 2}) == [{"CPU": 1}] * 2
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # the plan on a host of one GPU
    assert sources.for_params(one).device_split(one) == (
        "Ray places a capture actor and 1 trainer actor on this host's one GPU, half of it each (object store)",
        True,
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 16)
    split = placement.device_split(kimi)
    assert "capture actor (SGLang's interpreter) on 8 GPU(s) of one node and 4 trainer actor(s)" in split[0]
    assert not split[1]


def test_keep_best_writes_the_best_evaluated_state_and_a_spoiling_fine_tune_keeps_its_start(tmp_path, small_target):
    """train.keep_best_at: the drafter written is the evaluated state with the highest est. AL at that depth, the
    one training started from included: a fine-tune at a learning rate that spoils a trained drafter writes the
    drafter it started from (and its evaluation), where the last state would be written without the option."""
    run_dir = make_run(tmp_path, *small_target, {"max_tokens": 128 * 40, "eval_every": 40})
    p = load_params(params_file(tmp_path))
    trained, _ = build_setup(p, run_dir)
    loop.train(trained, p.train, log=lambda *a: None)
    start = run_dir / "trained-drafter"
    shutil.copytree(run_dir / "02_train" / "drafter", start)

    spoil = {"train.init_from": str(start), "train.lr": 0.2, "train.warmup_steps": 0, "train.max_tokens": 128 * 4}
    spoil |= {"train.eval_every": 2, "train.checkpoint_every": 2}
    for keep, expect_start in ((3, True), (None, False)):
        shutil.rmtree(run_dir / "02_train")
        p = load_params(params_file(tmp_path), spoil | {"train.keep_best_at": keep})
        setup, _ = build_setup(p, run_dir)
        summary = loop.train(setup, p.train, log=lambda *a: None)
        last = summary["last_eval"]["est_accept_len"]["3"]
        assert last < summary["initial_eval"]["est_accept_len"]["3"]  # the learning rate spoils it
        written = state(run_dir / "02_train" / "drafter")
        assert all(torch.equal(written[k], v) for k, v in state(start).items()) == expect_start
        if keep:
            assert summary["kept"] == {
                "rule": "best est. AL@3",
                "step": 0,
                "est_accept_len": summary["initial_eval"]["est_accept_len"]["3"],
                "last_step": 4,
                "last_est_accept_len": last,
            }
            assert summary["eval"]["est_accept_len"] == summary["initial_eval"]["est_accept_len"]
            assert "drafter kept" in train_notebook.result(summary)["headline"]
        else:
            assert summary["kept"] == {"rule": "last", "step": 4} and summary["eval"] == summary["last_eval"]
