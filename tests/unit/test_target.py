import json
import time

import pytest
import torch

from eagle3lib import target as T


def test_cache_built_once_and_reused(embedded_cache):
    cache, folder = embedded_cache
    assert folder == cache / T.EMBEDDED_DIR_NAME
    for name in ("config.json", "model.safetensors", "tokenizer.json", T.CACHE_MARKER):
        assert (folder / name).is_file(), name
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576 and config["vocab_size"] == 49152
    marker = json.loads((folder / T.CACHE_MARKER).read_text())
    assert marker["format_version"] == T.CACHE_FORMAT_VERSION and len(marker["source_sha256"]) == 64
    # The build left none of its temp folders (other tests of the session cache their own models here)
    assert not list(cache.glob(f".{T.EMBEDDED_DIR_NAME}.*-*"))

    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert T.embedded_target_dir(cache) == folder
    assert time.perf_counter() - t0 < 5
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime
    assert T.resolve_target(T.EMBEDDED_TARGET, cache) == str(folder)


def test_half_written_cache_is_rebuilt(tmp_path):
    folder = tmp_path / T.EMBEDDED_DIR_NAME
    folder.mkdir()
    (folder / "config.json").write_text("{half")  # a crash before the marker was written
    assert T.embedded_target_dir(tmp_path) == folder
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    assert (folder / T.CACHE_MARKER).is_file()
    assert [p.name for p in tmp_path.iterdir()] == [T.EMBEDDED_DIR_NAME]


def test_cached_model_matches_gguf(embedded_cache, embedded_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = T.embedded_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model, tok = embedded_target
    assert not model.training
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Name three colors."}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert ids.tolist() == ref_tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"].tolist()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    assert tok.chat_template == ref_tok.chat_template
    assert T.target_fingerprint(model.config) == T.target_fingerprint(ref.config)


def test_load_target_bf16(embedded_cache):
    model, _ = T.load_target(str(embedded_cache[1]), embedded_cache[0], dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and not model.training


def test_resolve_target(tmp_path, monkeypatch):
    assert T.resolve_target(str(tmp_path), tmp_path) == str(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert T.resolve_target("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):
        T.resolve_target("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path)
    with pytest.raises(ValueError, match=T.EMBEDDED_TARGET):
        T.resolve_target("embedded:nope", tmp_path)


def test_aux_layer_ids():
    assert T.default_aux_layer_ids(30) == [2, 15, 27]
    assert T.default_aux_layer_ids(32) == [2, 16, 29]
    assert T.check_aux_layer_ids((1, 5, 29), 30) == [1, 5, 29]
    assert T.aux_layer_ids(None, 30) == T.aux_layer_ids([], 30) == [2, 15, 27]  # not given: the default
    assert T.aux_layer_ids((1, 5, 29), 30) == [1, 5, 29]
    with pytest.raises(ValueError, match=r"1\.\.29"):
        T.aux_layer_ids([2, 15, 30], 30)
    for bad in (
        [0, 15, 27],
        [2, 15, 30],
        [2, 2, 27],
        [15, 2, 27],
        [2, 27],
        [2, 15, 27, 28],
        [2, 15.0, 27],
        [True, 15, 27],
    ):
        with pytest.raises(ValueError, match=r"1\.\.29"):
            T.check_aux_layer_ids(bad, 30)


def test_num_layers(embedded_target):
    assert T.num_layers(embedded_target[0].config) == 30


def test_contract_round_trip_and_mismatch(tmp_path, embedded_target):
    model, tok = embedded_target
    c = T.make_contract(T.EMBEDDED_TARGET, model, tok, [2, 15, 27], torch.float32)
    assert c["target"] == T.EMBEDDED_TARGET and c["dtype"] == "float32"
    assert (c["hidden_size"], c["vocab_size"], c["num_layers"]) == (576, 49152, 30)
    assert c["aux_layer_id_convention"] == "hf_hidden_states"
    assert c["draft_vocab_size"] is None and c["d2t_sha256"] is None
    T.write_contract(tmp_path, c)
    assert T.read_contract(tmp_path) == c
    T.check_contract(c, T.read_contract(tmp_path), "shards")

    found = {**c, "aux_layer_ids": [3, 15, 27], "dtype": "bfloat16", "draft_vocab_size": 8192}
    del found["chat_template_hash"]
    with pytest.raises(ValueError) as e:
        T.check_contract(c, found, "outputs/tiny/01_extract")
    msg = str(e.value)
    assert "outputs/tiny/01_extract" in msg and "Rerun" in msg
    assert "aux_layer_ids: expected [2, 15, 27], found [3, 15, 27]" in msg
    assert "dtype: expected 'float32', found 'bfloat16'" in msg
    assert "chat_template_hash: expected" in msg and "(missing)" in msg
    assert "draft_vocab_size" not in msg  # expected None: not compared

    with pytest.raises(ValueError, match="1..29"):
        T.make_contract(T.EMBEDDED_TARGET, model, tok, [0, 15, 27], "float32")
    with pytest.raises(FileNotFoundError, match="eagle3.json"):
        T.read_contract(tmp_path / "nowhere")


def test_the_weights_free_view_makes_the_same_contract_and_reply_ends(embedded_cache, embedded_target):
    """00_prepare and the engine extract backends use it for targets an engine serves."""
    from eagle3lib.prepare import regenerate

    model, tokenizer = embedded_target
    info, tok = T.load_target_info(T.EMBEDDED_TARGET, embedded_cache[0])
    assert not hasattr(info, "state_dict")
    assert T.make_contract("t", info, tok, [2, 15, 27], "bfloat16") == T.make_contract(
        "t", model, tokenizer, [2, 15, 27], "bfloat16"
    )
    assert regenerate.eos_token_ids(info, tok) == regenerate.eos_token_ids(model, tokenizer)


def test_fingerprint_ignores_volatile_fields(embedded_target):
    config = embedded_target[0].config
    other = type(config).from_dict(
        {**config.to_dict(), "transformers_version": "0.0", "_name_or_path": "/x", "dtype": "bfloat16"}
    )
    assert T.target_fingerprint(other) == T.target_fingerprint(config)
    other = type(config).from_dict({**config.to_dict(), "num_hidden_layers": 29})
    assert T.target_fingerprint(other) != T.target_fingerprint(config)


def test_chat_template_hash(embedded_target):
    tok = embedded_target[1]
    h = T.chat_template_hash(tok)
    saved = tok.chat_template
    try:
        tok.chat_template = saved + " "
        assert T.chat_template_hash(tok) != h
    finally:
        tok.chat_template = saved
    assert T.chat_template_hash(tok) == h
