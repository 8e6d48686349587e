"""Tests for eagle3lib.extract.shards and .hf on a tiny random Llama (the real architecture), real files on disk."""

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3lib.extract.backends import ExtractSettings, HFBackend
from eagle3lib.extract.hf import (
    HFCapture,
    capture_hidden_states,
    extract,
    iter_batches,
    make_batch,
    measure_forward_tokens_per_s,
)
from eagle3lib.extract.shards import (
    FORMAT,
    FP8,
    FP8_SCALING,
    ShardError,
    ShardLayout,
    ShardSet,
    bytes_per_token,
    dequantize,
    load_manifest,
    plan_batches,
    plan_shards,
    quantize,
    read_shard,
    verify_and_repair,
)
from eagle3lib.extract.sizing import SIZING_FILE, ExtractBudget, fitting, prefix
from eagle3lib.extract.sizing import text as sizing_text
from eagle3lib.prepare.conversations import load_tokens, save_tokens

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AUX = [2, 3, 3]  # [2, L//2, L-3] for L=6
CONTRACT = {
    "target": "tiny-random-llama",
    "hidden_size": 64,
    "vocab_size": 256,
    "aux_layer_ids": AUX,
    "dtype": "float32",
}
SMALL = dict(batch_tokens=256, shard_max_tokens=150, progress=False)


def tiny_model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def random_tokens(n_seqs=40, seed=1, max_len=60):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n_seqs,), generator=g)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    n = int(starts[-1])
    return {
        "input_ids": torch.randint(0, 256, (n,), generator=g, dtype=torch.int32),
        "loss_mask": torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8),
        "seq_starts": starts,
    }


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def tokens():
    return random_tokens()


def sequences(tok):
    st = tok["seq_starts"].tolist()
    return [(tok["input_ids"][a:b], tok["loss_mask"][a:b]) for a, b in zip(st[:-1], st[1:])]


def shard_state(out_dir):
    """Everything that must be identical between an interrupted and an uninterrupted run."""
    m = load_manifest(out_dir)
    return m["complete"], [
        (e["file"], e["sha256"], e["first_sequence"], e["sequences"], e["tokens"]) for e in m["shards"]
    ]


# --------------------------------------------------------------------------- capture


def test_capture_matches_output_hidden_states(model):
    ids = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    for layer_ids in ([2, 3, 3], [0, 1, 5], [5, 0]):
        aux, final = capture_hidden_states(model, ids, mask, layer_ids)
        assert aux.shape == (3, 17, 64 * len(layer_ids)) and final.shape == (3, 17, 64)
        for k, i in enumerate(layer_ids):  # id i == hidden_states[i]: residual after i layers, exactly
            assert torch.equal(aux[..., 64 * k : 64 * (k + 1)], ref.hidden_states[i]), (layer_ids, i)
        assert torch.equal(final, ref.hidden_states[-1])
        with torch.inference_mode():
            assert torch.equal(model.lm_head(final), ref.logits)
    assert not model.model.layers[0]._forward_pre_hooks  # hooks removed
    with pytest.raises(ValueError, match="expected 0 <= id < 6"):
        capture_hidden_states(model, ids, mask, [2, 6])


def test_padded_batch_matches_single_sequences(model, tokens):
    seq_ids = [3, 0, 7]
    ids, mask = make_batch(tokens, seq_ids)
    aux, final = capture_hidden_states(model, ids, mask, AUX)
    for b, (s_ids, _) in enumerate(sequences(tokens)[s] for s in seq_ids):
        a1, f1 = capture_hidden_states(model, s_ids.long()[None], torch.ones(1, len(s_ids), dtype=torch.long), AUX)
        n = len(s_ids)
        assert torch.equal(ids[b, :n], s_ids.long()) and mask[b].sum() == n
        torch.testing.assert_close(aux[b, :n], a1[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[b, :n], f1[0], rtol=1e-5, atol=1e-5)


def test_plans():
    lengths = [5, 50, 3, 20, 20, 1, 300]
    batches = plan_batches(lengths, range(7), batch_tokens=64)
    assert sorted(s for b in batches for s in b) == list(range(7))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[s] for s in b) <= 64
    assert [6] in batches  # longer than the budget: alone
    assert plan_shards(lengths, 0, 7, 60) == [(0, 4), (4, 7)]  # closes once >= 60
    assert plan_shards(lengths, 2, 6, 25) == [(2, 5), (5, 6)]


def test_one_batch_planner_for_every_capture():
    """Longest first (the extraction backends, bench.predict) or consecutive (online training's capture, the
    in-process engine's batches), padded or ragged; a sequence longer than the budget goes alone."""
    lengths = [5, 1, 4, 9, 2, 2, 20, 3]
    assert plan_batches(lengths, range(8), 10) == [[6], [3], [0, 2], [7, 4, 5], [1]]  # ties by id: 4 before 5
    assert plan_batches(lengths, range(8), 10, ragged=True) == [[6], [3], [0, 2], [7, 4, 5, 1]]
    padded = plan_batches(lengths, range(8), 10, in_order=True)
    assert padded == [[0, 1], [2], [3], [4, 5], [6], [7]]  # 3 x 5 > 10; 20 goes alone
    ragged = plan_batches(lengths, range(8), 10, ragged=True, in_order=True)
    assert ragged == [[0, 1, 2], [3], [4, 5], [6], [7]]  # 5 + 1 + 4 = 10
    assert plan_batches(lengths, [7, 0, 1], 10, in_order=True) == [[7, 0], [1]]  # the given order, not the ids'
    assert plan_batches(lengths, range(2, 5), 13, ragged=True, in_order=True) == [[2, 3], [4]]
    assert plan_batches(lengths, [], 10) == [] == plan_batches(lengths, range(3, 3), 8, ragged=True, in_order=True)


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("store_dtype", [torch.bfloat16, torch.float32])
def test_round_trip(model, tokens, tmp_path, store_dtype):
    out = str(tmp_path / "hidden")
    r = extract(model, tokens, AUX, out, CONTRACT, store_dtype=store_dtype, **SMALL)
    n = tokens["input_ids"].numel()
    assert r["sequences"] == 40 and r["tokens"] == n and r["complete"] and r["shards"] > 3
    assert r["tokens_per_s"] > 0
    assert r["bytes"] == sum(os.path.getsize(os.path.join(out, e["file"])) for e in load_manifest(out)["shards"])
    assert r["bytes_per_token"] >= 5 + 4 * 64 * store_dtype.itemsize
    with open(os.path.join(out, "eagle3.json")) as f:
        assert json.load(f) == CONTRACT
    first = load_manifest(out)["shards"][1]
    with safe_open(os.path.join(out, first["file"]), "pt") as f:  # safetensors' own reader agrees
        assert f.metadata()["first_sequence"] == str(first["first_sequence"])
        assert f.get_tensor("aux_hidden").dtype == store_dtype

    shards = ShardSet(out)
    assert len(shards) == 40 and shards.num_tokens == n and shards.contract == CONTRACT
    got = list(shards)
    assert len(got) == 40
    for (ids, mask), (g_ids, g_mask, aux, final) in zip(sequences(tokens), got):
        assert torch.equal(g_ids, ids) and torch.equal(g_mask, mask)
        assert aux.dtype == store_dtype and aux.shape == (len(ids), 192) and final.shape == (len(ids), 64)
        a1, f1 = capture_hidden_states(model, ids.long()[None], torch.ones(1, len(ids), dtype=torch.long), AUX)
        tol = dict(rtol=1e-5, atol=1e-5) if store_dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(aux.float(), a1[0], **tol)
        torch.testing.assert_close(final.float(), f1[0], **tol)

    # a rerun of a complete extraction does nothing
    mtimes = {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)}
    r2 = extract(model, tokens, AUX, out, CONTRACT, store_dtype=store_dtype, **SMALL)
    assert r2["sequences"] == 0 and r2["tokens"] == 0 and r2["tokens_per_s"] is None and r2["bytes"] == r["bytes"]
    assert mtimes == {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)}


def test_numpy_inputs_and_forward_measure(model, tokens, tmp_path):
    np_tokens = {k: v.numpy() for k, v in tokens.items()}
    extract(model, np_tokens, AUX, str(tmp_path / "a"), CONTRACT, **SMALL)
    extract(model, tokens, AUX, str(tmp_path / "b"), CONTRACT, **SMALL)
    assert shard_state(tmp_path / "a") == shard_state(tmp_path / "b")
    batches = list(iter_batches(tokens, 256, 150))
    assert sorted(s for b in batches for s in b[0]) == list(range(40))
    assert measure_forward_tokens_per_s(model, batches[:4]) > 0


# --------------------------------------------------------------------------- crash + resume

SCRIPT = """
import os, sys
os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
import torch, transformers
from safetensors.torch import load_file
from eagle3lib.extract.hf import extract
model = transformers.LlamaForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
extract(model, load_file(sys.argv[2]), {aux}, sys.argv[3], {contract}, batch_tokens=256, shard_max_tokens=60,
        progress=False)
"""


def test_kill9_resume_equals_uninterrupted(model, tokens, tmp_path):
    model_dir, tok_path = str(tmp_path / "model"), str(tmp_path / "tokens.safetensors")
    model.save_pretrained(model_dir)
    save_file(tokens, tok_path)
    script = tmp_path / "run_extract.py"
    script.write_text(textwrap.dedent(SCRIPT.format(aux=AUX, contract=CONTRACT)))
    env = dict(os.environ, PYTHONPATH=REPO, OMP_WAIT_POLICY="PASSIVE")

    ref = str(tmp_path / "ref")
    extract(
        transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(),
        tokens,
        AUX,
        ref,
        CONTRACT,
        batch_tokens=256,
        shard_max_tokens=60,
        progress=False,
    )
    complete, ref_shards = shard_state(ref)
    assert complete and len(ref_shards) > 10

    out = str(tmp_path / "out")
    rng = random.Random(0)
    interrupted = []

    def run_and_kill(when):
        p = subprocess.Popen([sys.executable, str(script), model_dir, tok_path, out], env=env)
        deadline = time.time() + 60
        while p.poll() is None and time.time() < deadline and not when():
            time.sleep(0.001)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait()
        m = load_manifest(out)
        interrupted.append(p.returncode == -signal.SIGKILL and not (m and m["complete"]))
        print(
            "killed" if interrupted[-1] else "finished",
            "with",
            len(m["shards"]) if m else None,
            "shards listed,",
            sorted(os.listdir(out)) if os.path.isdir(out) else None,
        )

    def shards_on_disk(k):
        return lambda: os.path.isdir(out) and sum(f.startswith("shard_") for f in os.listdir(out)) >= k

    def listed(k):
        return lambda: (load_manifest_safe(out) or {"shards": []})["shards"].__len__() >= k

    def random_time():
        def state():
            return sorted(os.listdir(out)) if os.path.isdir(out) else None

        start, t = state(), [None]

        def when():  # a random moment after this run has written something
            if t[0] is None and state() != start:
                t[0] = time.time() + rng.uniform(0, 0.03)
            return t[0] is not None and time.time() >= t[0]

        return when

    run_and_kill(shards_on_disk(1))  # right after the first shard file appears
    run_and_kill(random_time())
    run_and_kill(listed(len(ref_shards) // 2 + 1))
    run_and_kill(random_time())
    run_and_kill(random_time())
    assert sum(interrupted) >= 3, f"most kills should land mid-extraction: {interrupted}"
    # the state left by each kill is consistent: whatever is listed verifies
    assert verify_and_repair(out) == []
    subprocess.run([sys.executable, str(script), model_dir, tok_path, out], env=env, check=True)

    assert shard_state(out) == (True, ref_shards)  # same files, byte for byte (sha256), same order
    for a, b in zip(ShardSet(out), ShardSet(ref)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert sorted(f for f in os.listdir(out) if not f.startswith(".")) == sorted(os.listdir(ref))


def load_manifest_safe(out_dir):
    try:
        return load_manifest(out_dir)
    except (OSError, ValueError):
        return None


def test_crash_between_shard_rename_and_manifest_write(model, tokens, tmp_path):
    out = str(tmp_path / "hidden")
    extract(model, tokens, AUX, out, CONTRACT, **SMALL)
    want = shard_state(out)
    # the state a crash leaves after renaming the last shard but before the manifest lists it,
    # plus a half-written temp file of the next shard
    m = load_manifest(out)
    m["shards"].pop()
    m["complete"] = False
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(m, f)
    with open(os.path.join(out, ".shard_999999999.safetensors.tmp"), "wb") as f:
        f.write(b"\0" * 100)
    r = extract(model, tokens, AUX, out, CONTRACT, **SMALL)
    assert r["sequences"] == want[1][-1][3]
    assert shard_state(out) == want
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


# --------------------------------------------------------------------------- corruption


def test_corrupt_truncated_and_missing_shards_detected_and_repaired(model, tokens, tmp_path):
    out = str(tmp_path / "hidden")
    extract(model, tokens, AUX, out, CONTRACT, **SMALL)
    want = shard_state(out)
    files = [e[0] for e in want[1]]

    flipped = os.path.join(out, files[1])
    with open(flipped, "r+b") as f:
        f.seek(os.path.getsize(flipped) - 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ShardError, match=f"{files[1]}.*sha256.*Run the extract stage again .*--only 01_extract"):
        list(ShardSet(out))
    truncated = os.path.join(out, files[3])
    os.truncate(truncated, os.path.getsize(truncated) // 2)
    with pytest.raises(ShardError, match=f"{files[3]}.*truncated"):
        read_shard(truncated)  # without the manifest's sha256 the structure check still catches it
    os.remove(os.path.join(out, files[-1]))

    dropped = verify_and_repair(out)
    assert sorted(d[0] for d in dropped) == sorted([files[1], files[3], files[-1]])
    with pytest.raises(ValueError, match="incomplete.*rerun extract"):
        ShardSet(out)
    r = extract(model, tokens, AUX, out, CONTRACT, **SMALL)
    assert r["sequences"] == want[1][1][3] + want[1][3][3] + want[1][-1][3]  # just those shards' sequences
    assert shard_state(out) == want
    assert len(list(ShardSet(out))) == 40


def test_corrupt_shard_repaired_by_extract_directly(model, tokens, tmp_path):
    out = str(tmp_path / "hidden")
    extract(model, tokens, AUX, out, CONTRACT, **SMALL)
    want = shard_state(out)
    path = os.path.join(out, want[1][2][0])
    with open(path, "r+b") as f:
        f.seek(200)
        f.write(b"garbage!")
    r = extract(model, tokens, AUX, out, CONTRACT, **SMALL)
    assert r["sequences"] == want[1][2][3]
    assert shard_state(out) == want


# --------------------------------------------------------------------------- refusals


def test_changed_inputs_refused(model, tokens, tmp_path):
    out = str(tmp_path / "hidden")
    extract(model, tokens, AUX, out, CONTRACT, **SMALL)
    other = dict(tokens, input_ids=tokens["input_ids"].clone())
    other["input_ids"][5] = (other["input_ids"][5] + 1) % 256
    with pytest.raises(ValueError, match="(?s)input sequences differ.*input_sha256"):
        extract(model, other, AUX, out, CONTRACT, **SMALL)
    with pytest.raises(ValueError, match="(?s)settings differ.*store_dtype: folder has .bfloat16., this run .float16."):
        extract(model, tokens, AUX, out, CONTRACT, store_dtype=torch.float16, **SMALL)


def test_contract_mismatch_refused(model, tokens, tmp_path):
    out = str(tmp_path / "hidden")
    extract(model, random_tokens(5), AUX, out, CONTRACT, **SMALL)
    other = dict(CONTRACT, target="another-model", chat_template_sha256="abc")
    with pytest.raises(ValueError) as e:
        extract(model, random_tokens(5), AUX, out, other, **SMALL)
    msg = str(e.value)
    assert "'tiny-random-llama'" in msg and "'another-model'" in msg and "chat_template_sha256" in msg
    assert "hidden_size" not in msg  # only the keys that differ
    with pytest.raises(
        ValueError, match=r"contract\['aux_layer_ids'\] is \[2, 3, 3\] but this extraction has \[1, 2, 3\]"
    ):
        extract(model, random_tokens(5), [1, 2, 3], str(tmp_path / "other"), CONTRACT, **SMALL)


def test_disk_space_refused(model, tokens, tmp_path, capsys):
    out = str(tmp_path / "hidden")
    with pytest.raises(OSError) as e:
        extract(model, tokens, AUX, out, CONTRACT, free_bytes=12345, **SMALL)
    need = tokens["input_ids"].numel() * (5 + 4 * 64 * 2)
    msg = str(e.value)
    assert "12,345 bytes are free" in msg
    needed = int(msg.split("need ~")[1].split(" bytes")[0].replace(",", ""))
    assert need <= needed < need + 2**20
    assert f"{needed:,} bytes" in capsys.readouterr().out  # the estimate is printed
    assert not [f for f in os.listdir(out) if f.startswith("shard_")]


def test_bad_inputs_refused(model, tmp_path):
    tok = random_tokens(3)
    with pytest.raises(ValueError, match="length 0"):
        extract(
            model,
            dict(tok, seq_starts=torch.tensor([0, 0, int(tok["seq_starts"][-1])])),
            AUX,
            str(tmp_path / "a"),
            CONTRACT,
            **SMALL,
        )
    with pytest.raises(ValueError, match="vocab_size"):
        extract(model, dict(tok, input_ids=tok["input_ids"] + 1000), AUX, str(tmp_path / "b"), CONTRACT, **SMALL)


def test_shard_prefetch_yields_what_plain_reading_does(model, tokens, tmp_path, monkeypatch):
    from eagle3lib.train.runtime.batches import shard_sequences

    out = str(tmp_path / "hidden")
    extract(model, tokens, AUX, out, CONTRACT, **SMALL)
    shards = ShardSet(out)
    for epoch in (0, 1):
        plain = list(shard_sequences(shards, seed=3, epoch=epoch, prefetch=0))
        ahead = list(shard_sequences(shards, seed=3, epoch=epoch, prefetch=2))
        assert len(plain) == len(ahead) == 40
        for a, b in zip(plain, ahead):
            for x, y in zip((a.input_ids, a.loss_mask, a.aux, a.final), (b.input_ids, b.loss_mask, b.aux, b.final)):
                assert torch.equal(x, y)
    # each shard's sha256 is computed once: the second epoch read the same unchanged files without hashing
    hashed = []
    real_sha256 = hashlib.sha256
    monkeypatch.setattr(hashlib, "sha256", lambda data=b"": hashed.append(len(data)) or real_sha256(data))
    list(shard_sequences(shards, seed=3, epoch=2, prefetch=2))
    assert hashed == []
    assert len(list(shard_sequences(ShardSet(out), seed=3, epoch=2, prefetch=2))) == 40  # a new ShardSet hashes again
    assert len(hashed) == len(load_manifest(out)["shards"])
    # a bad shard met while prefetching is still reported, as the sha256 error of that file, also when it
    # changed after its sha256 was checked
    first = load_manifest(out)["shards"][0]["file"]
    path = os.path.join(out, first)
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        b = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ShardError, match=f"{first}.*sha256"):
        list(shard_sequences(shards, seed=3, epoch=0, prefetch=2))


def test_shard_whose_header_misdescribes_its_tensors_is_refused(tmp_path):
    good = str(tmp_path / "good.safetensors")
    n = 6
    save_file(
        {
            "input_ids": torch.arange(n, dtype=torch.int32),
            "loss_mask": torch.ones(n, dtype=torch.uint8),
            "aux_hidden": torch.randn(n, 12),
            "final_hidden": torch.randn(n, 4),
            "seq_starts": torch.tensor([0, 2, n]),
        },
        good,
        metadata={"format": FORMAT, "first_sequence": "0"},
    )
    t = read_shard(good)
    assert t["aux_hidden"].shape == (n, 12) and t["seq_starts"].tolist() == [0, 2, n]
    data = open(good, "rb").read()
    k = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + k])
    header["final_hidden"]["shape"] = [n, 3]  # 3 columns in the bytes of 4: a size mismatch, not a silent misread
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= k
    text = text.ljust(k)
    bad = str(tmp_path / "bad.safetensors")
    open(bad, "wb").write(data[:8] + text + data[8 + k :])
    with pytest.raises(ShardError, match="bad.safetensors.*final_hidden.*do not hold F32 \\[6, 3\\]"):
        read_shard(bad)


# --------------------------------------------------------------------------- fp8 shards


def test_fp8_round_trip_error_is_bounded_per_state(model, tokens, tmp_path):
    """e4m3 keeps 3 mantissa bits: with a float32 scale per token and state, each value is within 2^-4 of itself
    (relative; plus the bf16 the backend hands over), small values within the subnormal step of their scale."""
    ref_dir, out = str(tmp_path / "fp32"), str(tmp_path / "fp8")
    extract(model, tokens, AUX, ref_dir, CONTRACT, store_dtype=torch.float32, **SMALL)
    r = extract(model, tokens, AUX, out, CONTRACT, store_dtype=FP8, **SMALL)
    manifest = load_manifest(out)
    assert manifest["store_dtype"] == "float8_e4m3fn" and manifest["state_scaling"] == FP8_SCALING
    assert bytes_per_token(64, FP8, 3) == 5 + 4 * 64 + 16 <= 4 * 64 + 64
    headers = sum(e["bytes"] for e in manifest["shards"]) - r["tokens"] * bytes_per_token(64, FP8, 3)
    assert 0 < headers < 1024 * len(manifest["shards"])  # the rest is each file's safetensors header
    first = manifest["shards"][0]
    with safe_open(os.path.join(out, first["file"]), "pt") as f:  # safetensors' own reader agrees
        assert f.get_tensor("aux_hidden").dtype == FP8 and f.get_tensor("aux_scale").shape == (first["tokens"], 3)
    names = [f"aux_{i}" for i in AUX] + ["final"]
    worst = dict.fromkeys(names, 0.0)
    for (_, _, aux8, fin8), (_, _, aux, fin) in zip(ShardSet(out), ShardSet(ref_dir)):
        assert aux8.dtype == torch.bfloat16  # dequantized on read
        for k, name in enumerate(names):
            x = (aux[:, k * 64 : (k + 1) * 64] if k < 3 else fin).float()
            y = (aux8[:, k * 64 : (k + 1) * 64] if k < 3 else fin8).float()
            scale = x.abs().amax(-1, keepdim=True) / 448
            bound = (2**-4 + 2**-7) * x.abs() + scale * 2**-9 + 1e-6
            assert ((y - x).abs() <= bound).all(), name
            worst[name] = max(worst[name], float((y - x).norm() / x.norm()))
    assert all(0 < v < 0.04 for v in worst.values()), worst


def test_fp8_shards_resume_and_refuse_corruption_and_a_dtype_change(model, tokens, tmp_path):
    out = str(tmp_path / "fp8")
    full = extract(model, tokens, AUX, out, CONTRACT, store_dtype=FP8, **SMALL)
    manifest = load_manifest(out)
    victim = os.path.join(out, manifest["shards"][2]["file"])
    data = bytearray(open(victim, "rb").read())
    data[-10] ^= 0xFF  # a flipped bit in the last state's bytes
    open(victim, "wb").write(data)
    with pytest.raises(ShardError, match=f"{os.path.basename(victim)}.*sha256"):
        ShardSet(out).verify_all()
    before = {e["file"]: e["sha256"] for e in manifest["shards"]}
    r = extract(model, tokens, AUX, out, CONTRACT, store_dtype=FP8, **SMALL)  # redoes only that shard
    assert r["sequences"] == manifest["shards"][2]["sequences"] and r["bytes"] == full["bytes"]
    assert {e["file"]: e["sha256"] for e in load_manifest(out)["shards"]} == before  # byte-identical again
    with pytest.raises(ValueError, match="(?s)settings differ.*store_dtype: folder has .float8_e4m3fn., this run"):
        extract(model, tokens, AUX, out, CONTRACT, store_dtype=torch.bfloat16, **SMALL)


def test_fp8_shard_without_its_scales_is_refused(tmp_path):
    n = 6
    path = str(tmp_path / "noscale.safetensors")
    save_file(
        {
            "input_ids": torch.arange(n, dtype=torch.int32),
            "loss_mask": torch.ones(n, dtype=torch.uint8),
            "aux_hidden": torch.randn(n, 12).to(FP8),
            "final_hidden": torch.randn(n, 4).to(FP8),
            "seq_starts": torch.tensor([0, 2, n]),
        },
        path,
        metadata={"format": FORMAT, "first_sequence": "0"},
    )
    with pytest.raises(ShardError, match="noscale.safetensors.*fp8 states need their scales"):
        read_shard(path)


def test_quantize_keeps_zero_rows_and_outliers():
    x = torch.zeros(4, 3 * 8)
    x[1, :8] = torch.linspace(-3, 3, 8)
    x[2, 8] = 1e4  # one huge value: its token's other state keeps its own scale
    x[2, 16:] = 1e-3
    q, scale = quantize(x, 3)
    y = dequantize(q, scale, torch.float32)
    assert torch.equal(y[0], x[0]) and y[2, 8] == 1e4
    torch.testing.assert_close(y, x, rtol=2**-4, atol=0)


# --------------------------------------------------------------------------- sized to its minutes


def test_the_train_split_cut_keeps_whole_leading_sequences():
    tok = random_tokens(5, seed=3) | {"ids": list("abcde"), "stats": {}}
    ends = tok["seq_starts"][1:].tolist()
    assert fitting(tok["seq_starts"], ends[2]) == 3 and fitting(tok["seq_starts"], ends[2] - 1) == 2
    assert fitting(tok["seq_starts"], -5.0) == 1  # never empty
    cut = prefix(tok, 2)
    assert cut["ids"] == ["a", "b"] and cut["seq_starts"].tolist() == tok["seq_starts"][:3].tolist()
    assert torch.equal(cut["input_ids"], tok["input_ids"][: ends[1]]) and len(cut["loss_mask"]) == ends[1]


def test_extraction_out_of_minutes_times_val_cuts_train_and_a_rerun_keeps_the_cut(model, tmp_path):
    """extract.max_minutes: val is extracted first and timed; train keeps the leading sequences that fit what is
    left (none of the minutes here: one sequence); sizing.json records it before train starts, and a rerun takes
    it back instead of timing again (a cut raised by hand is obeyed); with minutes to spare nothing is cut."""
    prep = tmp_path / "prep"
    for name, n, seed in (("train", 40, 1), ("val", 10, 2)):
        save_tokens(prep / f"{name}.safetensors", random_tokens(n, seed) | {"ids": [f"{name}{i}" for i in range(n)]})
    settings = ExtractSettings(AUX, CONTRACT, ShardLayout(torch.float32, 150, 256), 0)
    backend = HFBackend(HFCapture(model, AUX, 256), settings)

    def run(out, minutes):
        budget = ExtractBudget(out, minutes)
        files = {s: (prep / f"{s}.safetensors", out / s) for s in ("train", "val")}
        return backend.extract_splits(files, budget), budget

    out = tmp_path / "short"
    results, budget = run(out, 1e-5)
    assert list(results) == ["val", "train"] and results["train"]["total_sequences"] == 1
    assert results["val"]["total_sequences"] == 10 and ShardSet(out / "train").num_tokens == results["train"]["tokens"]
    rec = json.loads((out / SIZING_FILE).read_text())
    assert rec == budget.decision and (rec["sequences"], rec["total_sequences"]) == (1, 40)
    assert rec["tokens_per_s"] == round(results["val"]["tokens_per_s"], 1) and rec["seconds_left"] <= 0
    assert rec["text"].startswith("train split sized to its first 1 of 40 sequences")

    rec["sequences"] = 7  # as if the first run had cut at 7: the rerun of a lost train split extracts those
    (out / SIZING_FILE).write_text(json.dumps(rec))
    shutil.rmtree(out / "train")
    results, budget = run(out, 1e-5)
    assert results["train"]["total_sequences"] == 7 and results["val"]["tokens"] == 0 and budget.decision["resumed"]
    assert sizing_text(budget.decision) == "train split: the first 7 of 40 sequences, as sized before"

    results, budget = run(tmp_path / "long", 60.0)
    assert results["train"]["total_sequences"] == 40 and budget.decision["text"].startswith("train split not cut")


def test_extraction_to_a_number_of_train_tokens_keeps_a_prefix_and_the_smaller_cut_with_minutes(model, tmp_path):
    """extract.max_train_tokens: the train split keeps its leading sequences within the tokens (val whole), so that
    two sizes of one dataset are a prefix of each other; with minutes to spare the tokens decide, with none left
    the minutes do; a rerun with another size cuts again instead of taking the recorded cut back."""
    prep = tmp_path / "prep"
    for name, n, seed in (("train", 40, 1), ("val", 10, 2)):
        save_tokens(prep / f"{name}.safetensors", random_tokens(n, seed) | {"ids": [f"{name}{i}" for i in range(n)]})
    starts = load_tokens(prep / "train.safetensors")["seq_starts"]
    settings = ExtractSettings(AUX, CONTRACT, ShardLayout(torch.float32, 150, 256), 0)
    backend = HFBackend(HFCapture(model, AUX, 256), settings)

    def run(out, minutes, tokens):
        budget = ExtractBudget(out, minutes, tokens)
        files = {s: (prep / f"{s}.safetensors", out / s) for s in ("train", "val")}
        return backend.extract_splits(files, budget), budget

    small, big = int(starts[12]), int(starts[30]) - 1  # 12 sequences exactly; 29 fit under the 30th's end
    results, budget = run(tmp_path / "small", None, small)
    assert results["train"]["total_sequences"] == 12 and results["val"]["total_sequences"] == 10
    assert budget.decision["text"] == (
        f"train split sized to its first 12 of 40 sequences ({small:,} tokens): at most {small:,} tokens "
        "(extract.max_train_tokens)"
    )
    results, _ = run(tmp_path / "big", 60.0, big)
    assert results["train"]["total_sequences"] == 29
    small_ids = [ids for ids, *_ in ShardSet(tmp_path / "small" / "train")]
    big_ids = [ids for ids, *_ in ShardSet(tmp_path / "big" / "train")]
    assert all(torch.equal(a, b) for a, b in zip(small_ids, big_ids[:12], strict=True))

    assert ExtractBudget(tmp_path / "big", 60.0, small).recorded() is None  # another size: cut again, not resumed
    assert ExtractBudget(tmp_path / "big", 60.0, big).recorded()["sequences"] == 29
    results, budget = run(tmp_path / "short", 1e-5, big)  # no minutes left: the minutes cut more than the tokens
    assert results["train"]["total_sequences"] == 1 and "1e-05 min (extract.max_minutes)" in budget.decision["text"]
