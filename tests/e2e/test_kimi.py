"""Kimi-K2.5's real inputs: its tiktoken tokenizer rebuilt without remote code (golden ids), its tool declarations
(golden TypeScript), its chat template's loss masks token by token, and its multimodal-wrapper config."""

import json
from pathlib import Path

import pytest
from test_data import masked_runs as runs  # the decoded text of each run of masked tokens

from eagle3lib import target
from eagle3lib.prepare import conversations as D
from eagle3lib.target.tool_declarations import typescript_declaration

# published in public tokenizer test suites (../shared/fixtures/kimi-k2.5/SOURCES.md)
GOLDEN_IDS = {
    "Hello, world!": [19180, 11, 2695, 0],
    "Hello, world! 你好，世界！": [19180, 11, 2695, 0, 220, 33845, 378, 2243, 856],
    "你好世界": [33845, 2243],
    "1234567890": [6694, 12972, 16242, 15],
    "中文English混合": [16717, 44372, 13935],
}
IM_END, IM_USER, IM_ASSISTANT, IM_MIDDLE = 163586, 163587, 163588, 163601
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok(kimi_folder):
    return target.load_tokenizer(kimi_folder)


def test_the_tokenizer_reproduces_the_golden_ids(tok):
    assert type(tok).__name__ == "TikTokenTokenizer"
    for text, ids in GOLDEN_IDS.items():
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == text
    assert len(tok) == 163840 and tok.eos_token == "[EOS]" and tok.eos_token_id == 163585
    assert tok.pad_token_id == 163839
    # the template's markers are single ids; the 256 ids without a name are reserved
    hi = tok.encode("hi")
    assert tok.encode("<|im_user|>user<|im_middle|>hi<|im_end|>") == [IM_USER, 2482, IM_MIDDLE, *hi, IM_END]
    assert tok.encode("<|tool_call_begin|>") == [163597]
    assert tok.convert_tokens_to_ids("<|reserved_token_163600|>") == 163600
    # skip_special_tokens drops the special ones and keeps the tool-call markers (special: false in the config)
    assert tok.decode([IM_USER, *hi, 163597], skip_special_tokens=True) == "hi<|tool_call_begin|>"


def test_batches_pad_on_the_left_as_tensors(tok):
    enc = tok(["你好世界", "Hello, world!"], padding=True, return_tensors="pt")
    assert enc["input_ids"].tolist() == [[163839] * 2 + [33845, 2243], GOLDEN_IDS["Hello, world!"]]
    assert enc["attention_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


def test_tool_declarations_match_kimis_own_encoder(kimi_fixtures):
    folder = kimi_fixtures / "smg_tool_declaration_ts"
    schemas = sorted((folder / "schemas").glob("*.json"))
    assert len(schemas) == 13
    for schema in schemas:
        want = (folder / "expected" / f"{schema.stem}.txt").read_text()
        assert typescript_declaration(json.loads(schema.read_text())) == want, schema.stem


def test_the_chat_template_declares_tools_in_typescript(tok, kimi_fixtures):
    tools = json.loads((kimi_fixtures / "smg_tool_declaration_ts/schemas/01_simple_string.json").read_text())
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, tokenize=False)
    want = (kimi_fixtures / "smg_tool_declaration_ts/expected/01_simple_string.txt").read_text()
    assert text.startswith(f"<|im_system|>tool_declare<|im_middle|>{want}<|im_end|><|im_user|>user<|im_middle|>hi")


PLAIN = [
    {"role": "system", "content": "You are Kimi."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 你好?"},
    {"role": "assistant", "content": "Hello, in Chinese."},
]


def test_loss_masks_of_a_plain_conversation(tok):
    ((ids, mask),) = D.tokenize_conversation(tok, PLAIN, 4096)
    text = tok.apply_chat_template(PLAIN, tokenize=False)
    assert tok.decode(ids) == text
    # the generation prompt ends with <think>; the model writes </think>, the reply and <|im_end|>
    assert runs(tok, ids, mask) == ["</think>4.<|im_end|>", "</think>Hello, in Chinese.<|im_end|>"]
    for i, m in zip(ids, mask):  # token by token: no header, system or user token is trained on
        assert not m or i not in (IM_USER, IM_ASSISTANT, IM_MIDDLE)
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert "You are Kimi." in unmasked and "And 你好?" in unmasked
    assert D.end_of_turn_ids(tok) == {IM_END}


def test_thinking_in_the_history_is_what_the_template_keeps(tok):
    """Kimi's template drops the reasoning of every answered turn: the masks follow the rendered text, and the
    dropped reasoning is counted, not silently trained on or lost."""
    thought = [m | {"reasoning_content": "Let me add."} if m["role"] == "assistant" else m for m in PLAIN]
    ((ids, mask),) = D.tokenize_conversation(tok, thought, 4096)
    assert "Let me add." not in tok.decode(ids)
    assert runs(tok, ids, mask) == ["</think>4.<|im_end|>", "</think>Hello, in Chinese.<|im_end|>"]
    split = D.tokenize_split(tok, [{"id": "t", "messages": thought}], 4096, progress=False)
    assert split["stats"]["reasoning_dropped_turns"] == 2


TOOLS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should call the tool.",
        "tool_calls": [
            {
                "id": "functions.weather:0",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
            },
        ],
    },  # fmt: skip
    {"role": "tool", "tool_call_id": "functions.weather:0", "content": "18 C, sunny"},
    {"role": "assistant", "content": "It is 18 C and sunny."},
]


def test_loss_masks_of_a_tool_call_conversation(tok):
    """The tool-call turn is rendered with its reasoning while it is in progress, and the final answer is
    trained in that context: one sequence, the tool's result not trained on."""
    ((ids, mask),) = D.tokenize_conversation(tok, TOOLS, 4096)
    call = (
        "I should call the tool.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    )
    assert runs(tok, ids, mask) == [call, "</think>It is 18 C and sunny.<|im_end|>"]
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert "## Return of functions.weather:0\n18 C, sunny<|im_end|>" in unmasked
    assert 163595 in ids  # <|tool_calls_section_begin|> is one token


def test_the_wrapper_config_reads_without_remote_code(kimi_folder):
    info, _ = target.load_target_info(str(kimi_folder), kimi_folder)
    text = info.config.text_config
    assert info.config.architectures == ["KimiK25ForConditionalGeneration"]
    assert (target.num_layers(info.config), text.hidden_size, text.vocab_size) == (61, 7168, 163840)
    assert target.default_aux_layer_ids(61) == [2, 30, 58]
    # transformers versions without kimi_k25 read it through the DeepSeek-V3 family
    raw = json.loads((kimi_folder / "config.json").read_text())
    wrapped = target.WrapperConfig(raw)
    assert type(wrapped.text_config).__name__ == "DeepseekV3Config"
    assert (target.num_layers(wrapped), wrapped.text_config.n_routed_experts) == (61, 384)
    assert wrapped.quantization_config["quant_method"] == "compressed-tensors"
    with pytest.raises(ValueError, match="text_config"):
        target.WrapperConfig(raw | {"text_config": {**raw["text_config"], "model_type": "no_such_model"}})


def test_the_quantized_wrapper_is_refused_in_process_with_the_engine_backends_named(kimi_folder):
    with pytest.raises(ValueError, match="extract.backend: sglang or vllm"):
        target.load_target(str(kimi_folder), kimi_folder)


@pytest.fixture(scope="module")
def kimi_tiny_run(kimi_folder, tmp_path_factory):
    """kimi-k2.5-tiny-cpu.yaml through 03_convert on a tiny copy of the Kimi folder (random weights, real tokenizer
    and template); (run dir, the tiny target's folder)."""
    from eagle3lib.workbook import pipeline

    out = tmp_path_factory.mktemp("kimi-run")
    overrides = {"target.name": f"tiny:{kimi_folder}", "run.output_root": str(out), "run.cache_dir": str(out / "cache")}
    pipeline.run_pipeline(ROOT / "params" / "kimi-k2.5-tiny-cpu.yaml", overrides, to_stage="convert", log_output=False)
    return out / "kimi-tiny", target.resolve_target(f"tiny:{kimi_folder}", out / "cache")


def result(run_dir, stage):
    return json.loads((run_dir / stage / "result.json").read_text())


@pytest.mark.slow
def test_a_tiny_kimi_target_goes_through_prepare_extract_train_and_convert(kimi_tiny_run):
    from eagle3lib.extract import shards
    from eagle3lib.prepare import conversations

    run_dir, tiny = kimi_tiny_run
    config = json.loads((Path(tiny) / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["vocab_size"] == 163840
    assert config["n_routed_experts"] == 8 and config["hidden_size"] == 256
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (512, 64)  # Kimi's latent, as vLLM's CPU MLA needs
    rope = config.get("rope_parameters") or config["rope_scaling"]  # Kimi-K2.5's YaRN, factor 64
    assert (rope.get("rope_type") or rope["type"]) == "yarn" and rope["factor"] == 64.0
    prepared = result(run_dir, "00_prepare")["figures"]
    assert prepared["target"]["aux_layer_ids"] == [2, 4, 5] and prepared["tokens"]["train"]["loss_tokens"] > 0
    assert prepared["regenerate"]["tokens_generated"] > 0
    tok = target.load_tokenizer(tiny)
    train = conversations.load_tokens(run_dir / "00_prepare" / "train.safetensors")
    ids, mask = train["input_ids"].tolist(), train["loss_mask"].tolist()
    assert IM_ASSISTANT in ids and all(not m for i, m in zip(ids, mask) if i in (IM_USER, IM_ASSISTANT, IM_MIDDLE))
    starts = train["seq_starts"].tolist()
    for a, b in zip(starts, starts[1:]):  # each reply from </think> through <|im_end|>, the last maybe cut short
        replies = runs(tok, ids[a:b], mask[a:b])
        assert replies and all(r.startswith("</think>") for r in replies)
        assert all(r.endswith("<|im_end|>") for r in replies[:-1])
        assert replies[-1].endswith("<|im_end|>") or b - a == 256
    shard_set = shards.ShardSet(run_dir / "01_extract" / "train")
    assert shard_set.contract["aux_layer_ids"] == [2, 4, 5] and shard_set.contract["hidden_size"] == 256
    assert shard_set.contract["vocab_size"] == 163840 and shard_set.verify_all() > 0
    assert result(run_dir, "02_train")["status"] == "ok"
    converted = result(run_dir, "03_convert")["figures"]
    assert set(converted["exports"]) == {"sglang", "vllm", "speculators"}
    for name, v in converted["verified"].items():
        assert v["ok"] and v["loaded"] == v["expected"], (name, v)
    sglang_config = json.loads((Path(converted["exports"]["sglang"]) / "config.json").read_text())
    # DeepSeek-V3's first-id rule: our [2, 4, 5] are SGLang config ids [1, 3, 4]
    assert sglang_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]


def released_drafter(kimi_fixtures, name: str, tiny_config: dict, out: Path) -> Path:
    """A checkpoint in the layout and config of a published Kimi-K2.5 drafter (SpecForge's midlayer.* with a
    32,000-token draft vocabulary and d2t; TorchSpec's full 163,840-token head without d2t, YaRN rope), its
    sizes shrunk to the tiny target's hidden size, random weights."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((kimi_fixtures / "drafter_configs" / name).read_text())
    h, heads, hd, inter = tiny_config["hidden_size"], 4, 32, 384
    config.update(hidden_size=h, num_attention_heads=heads, num_key_value_heads=heads, head_dim=hd)
    config["intermediate_size"] = inter
    if "eagle_config" in config:  # SGLang's ids on KimiK25 / DeepSeek-V3: taken as they are unless the first is 1
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]
    vocab, draft = config["vocab_size"], config.get("draft_vocab_size") or config["vocab_size"]
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g) * 0.02  # noqa: E731
    m = "midlayer."
    tensors = {
        "fc.weight": rnd(h, 3 * h),
        "norm.weight": torch.ones(h),
        "lm_head.weight": rnd(draft, h),
        "embed_tokens.weight": rnd(vocab, h),  # SpecForge saves it; the engines take the target's
        m + "input_layernorm.weight": torch.ones(h),
        m + "hidden_norm.weight": torch.ones(h),
        m + "post_attention_layernorm.weight": torch.ones(h),
        m + "self_attn.q_proj.weight": rnd(heads * hd, 2 * h),
        m + "self_attn.k_proj.weight": rnd(heads * hd, 2 * h),
        m + "self_attn.v_proj.weight": rnd(heads * hd, 2 * h),
        m + "self_attn.o_proj.weight": rnd(h, heads * hd),
        m + "mlp.gate_proj.weight": rnd(inter, h),
        m + "mlp.up_proj.weight": rnd(inter, h),
        m + "mlp.down_proj.weight": rnd(h, inter),
    }
    if draft < vocab:
        d2t = torch.arange(draft) * 3 - torch.arange(draft)  # draft id i -> target id 3i, stored as the offset
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[torch.arange(draft) * 3] = True
        tensors |= {"d2t": d2t, "t2d": t2d}
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["specforge_kimi-k25-eagle3.json", "torchspec_kimi_k25_eagle3.json"])
def test_the_released_kimi_drafters_convert_and_pass_the_gates(kimi_fixtures, kimi_tiny_run, tmp_path, name):
    from eagle3lib.convert import gate, layouts

    run_dir, tiny = kimi_tiny_run
    config = json.loads((Path(tiny) / "config.json").read_text())
    src = released_drafter(kimi_fixtures, name, config, tmp_path / "released")
    contract = target.read_contract(run_dir / "00_prepare")
    canonical = layouts.import_checkpoint(src, tmp_path / "canonical", contract)
    imported = target.read_contract(canonical)
    assert imported["aux_layer_ids"] == [2, 4, 5]  # SGLang's ids on a DeepSeek-V3 target, read as SGLang reads them
    assert imported["draft_vocab_size"] == (32000 if "specforge" in name else 163840)
    for engine in ("sglang", "vllm"):
        folder = layouts.export(canonical, engine, tmp_path / engine, target=tiny)
        report = gate.verify(folder, engine, target=tiny)
        assert report["ok"], (engine, report["problems"])
        assert report["counts"]["loaded"] == report["counts"]["expected"], report["counts"]


def test_the_kimi_params_hold_against_the_real_config(kimi_folder, kimi_fixtures, tmp_path):
    """params/kimi-k2.5-8gpu.yaml read against Kimi-K2.5's config.json: the layer count and aux ids, the drafter's
    shape as the published SpecForge drafter has it, SGLang's ids for the capture, and the launch flags."""
    from eagle3lib.drafter import DrafterConfig
    from eagle3lib.engines import sglang
    from eagle3lib.params import load_params

    p = load_params(ROOT / "params" / "kimi-k2.5-8gpu.yaml", {"target.name": str(kimi_folder)})
    info, _ = target.load_target_info(p.target.name, tmp_path, trust_remote_code=p.target.trust_remote_code)
    layers = target.num_layers(info.config)
    assert p.target.num_layers == layers == 61
    aux = target.aux_layer_ids(p.target.aux_layer_ids, layers)
    assert aux == [2, 30, 58]
    drafter = DrafterConfig.from_target(info.config, p.train.draft_vocab_size, aux)
    published = json.loads((kimi_fixtures / "drafter_configs" / "specforge_kimi-k25-eagle3.json").read_text())
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "vocab_size", "draft_vocab_size"):  # fmt: skip
        assert getattr(drafter, key) == published[key], key
    arch = info.config.architectures[0]
    ours = sglang.sglang_config_ids(aux, arch)
    theirs = published["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert sglang.sglang_captured_ids(ours, arch, layers) == sglang.sglang_captured_ids(theirs, arch, layers) == aux
    # 01_extract: SGLang's model runner in process captures exactly these on Kimi's class; fp8 halves the seed's disk
    from eagle3lib.extract import notebook as extract_notebook
    from eagle3lib.extract import sglang_inprocess, shards

    assert (p.extract.backend, p.extract.store_dtype) == ("sglang_inprocess", "float8_e4m3fn")
    sglang_inprocess.check_captured(sglang.sglang_captured_ids(ours, arch, layers), aux, arch)
    contract = {
        "hidden_size": target.text_config(info.config).hidden_size,
        "aux_layer_ids": aux,
        "target_fingerprint": "k",
    }
    plan = extract_notebook.plan_text(p, contract, 87_800_000, free_bytes=3 * 10**12)
    assert shards.bytes_per_token(7168, shards.FP8, 3) == 28_693
    assert "87,800,000 tokens x 28,693 bytes (4 states of 7168 in float8_e4m3fn + 4 float32 scales) = 2,519" in plan
    flags = sglang.server_flags(kimi_folder, tmp_path / "draft", 5, p.engine.extra_args)
    assert flags[flags.index("--tp") + 1] == "8" and "--trust-remote-code" in flags
    assert flags[flags.index("--speculative-num-draft-tokens") + 1] == "6"


def test_sglang_resolves_the_kimi_launch_against_the_real_config(kimi_folder, kimi_fixtures, tmp_path):
    """SGLang's own ServerArgs reads the 8-GPU, remote-code launch of params/kimi-k2.5-8gpu.yaml against Kimi-K2.5's
    config.json (no weights: resolution only, `--device cpu`), and captures the layers the drafter reads."""
    from conftest import need_engine

    from eagle3lib.engines import sglang
    from eagle3lib.params import load_params

    py = need_engine("sglang")
    p = load_params(ROOT / "params" / "kimi-k2.5-8gpu.yaml", {"target.name": str(kimi_folder)})
    draft = tmp_path / "draft"  # the published SpecForge drafter's config: what SGLang reads of a drafter here
    draft.mkdir()
    (draft / "config.json").write_text(
        (kimi_fixtures / "drafter_configs" / "specforge_kimi-k25-eagle3.json").read_text()
    )
    report = sglang.preflight(kimi_folder, draft, 5, py, extra_args=p.engine.extra_args, aux_layer_ids=[2, 30, 58])
    assert report["resolved"]["tp_size"] == 8 and report["resolved"]["trust_remote_code"] is True
    assert report["resolved"]["speculative_num_steps"] == 5
    assert report["captured_hf_layers"] == [2, 30, 58]


@pytest.mark.slow
def test_vllm_extracts_the_tiny_kimi_target_as_hf_does(kimi_folder, tmp_path):
    """vLLM's CPU build runs the DeepSeek-V3 shape (MLA, MoE, YaRN) of the tiny Kimi copy: the vllm backend's
    shards (Kimi's tokenizer through its template, token ids in, no tokenizer in vLLM) equal the hf backend's."""
    import torch
    from conftest import FAST_START, need_engine

    from eagle3lib.extract import compare, hf, shards
    from eagle3lib.extract.vllm import VLLMCapture
    from eagle3lib.prepare import sources

    py = need_engine("vllm")
    tiny = target.resolve_target(f"tiny:{kimi_folder}", tmp_path / "cache")
    model, tok = target.load_target(tiny, tmp_path / "cache")
    convs, _ = sources.load_conversations(sources.EMBEDDED_DATA, limit=4)
    tokens = D.tokenize_split(tok, convs, 160, progress=False)
    aux = target.default_aux_layer_ids(target.num_layers(model.config))
    contract = target.make_contract(f"tiny:{kimi_folder}", model, tok, aux, "float32")
    kw = dict(batch_tokens=1024, shard_max_tokens=400, store_dtype=torch.float32, progress=False)
    ref = hf.extract(model, tokens, aux, str(tmp_path / "hf"), contract, **kw)
    layout = shards.ShardLayout(torch.float32, shard_max_tokens=400, batch_tokens=1024)
    capture = VLLMCapture(
        tiny,
        aux,
        dtype="float32",
        python=str(py),
        extra_args=[*FAST_START, "--skip-tokenizer-init", "--max-model-len", "1024"],
        log_dir=tmp_path / "logs",
        prefill_benchmark_batches=1,
        batch_tokens=1024,
    )
    with capture:
        got = shards.extract_with(capture, tokens, aux, str(tmp_path / "vllm"), contract, layout, progress=False)
    assert got["complete"] and got["shards"] == ref["shards"] and got["tokens"] == tokens["input_ids"].numel()
    agree = compare.compare_shard_sets(
        tmp_path / "vllm", tmp_path / "hf", lm_head=model.lm_head.weight.detach(), rel_tol=1e-4
    )
    print(json.dumps(agree))
    assert set(agree["layers"]) == {"aux_2", "aux_4", "aux_5", "final"}
    assert agree["ok"] and agree["argmax_agree"] == 1.0, agree
