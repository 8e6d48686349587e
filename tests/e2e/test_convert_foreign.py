"""03_convert from the command line for drafters trained elsewhere: a checkpoint without eagle3.json
takes its contract from `--target`, the target it was trained for, and goes through convert and both gates.

The target is a tiny random Llama (8 layers, hidden 64) with the embedded SmolLM2's tokenizer, built here. The
speculators checkpoint is written by speculators 0.9.0 itself in .venv-speculators (`make speculators-env`); the
EAGLE/SpecForge one is laid out here as SpecForge saves it (midlayer.*, eagle_config ids in SGLang's convention).
"""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import need_engine
from safetensors.torch import save_file
from test_export import edited
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from eagle3lib.__main__ import main as cli
from eagle3lib.convert import layouts
from eagle3lib.drafter.vocab import build_draft_vocab
from eagle3lib.engines.interpreter import engine_env
from eagle3lib.target import chat_template_hash, load_config, target_fingerprint

HIDDEN, LAYERS, VOCAB, DRAFT_VOCAB = 64, 8, 49152, 512
SPECULATORS_AUX = [1, 4, 6]  # not the default [2, 4, 5]: the ids come from the checkpoint
SPECFORGE_IDS = [1, 3, 5]  # SGLang's convention: HF hidden_states [2, 4, 6] on a Llama target


def target_folder(folder: Path, tokenizer=None, architecture="LlamaForCausalLM", **sizes) -> Path:
    """A target folder: weights and tokenizer for the Llama one; config.json alone (no tokenizer) otherwise."""
    fields = dict(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=2048, tie_word_embeddings=False)  # fmt: skip
    fields.update(sizes)
    if tokenizer is None:
        from transformers import AutoConfig

        model_type = {"LlamaForCausalLM": "llama", "DeepseekV3ForCausalLM": "deepseek_v3"}[architecture]
        config = AutoConfig.for_model(model_type, **fields)
        config.architectures = [architecture]
        config.save_pretrained(folder)
        return folder
    torch.manual_seed(0)
    config = LlamaConfig(**fields, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config.architectures = [architecture]
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama_target(tmp_path_factory, embedded_cache) -> Path:
    return target_folder(tmp_path_factory.mktemp("llama8"), AutoTokenizer.from_pretrained(embedded_cache[1]))


@pytest.fixture(scope="module")
def speculators_checkpoint(tmp_path_factory, llama_target) -> Path:
    """A drafter saved by speculators 0.9.0's Eagle3DraftModel.save_pretrained (tests/speculators_save.py)."""
    py = need_engine("speculators")
    out = tmp_path_factory.mktemp("speculators") / "drafter"
    script = Path(__file__).resolve().parents[1] / "speculators_save.py"
    args = [py, str(script), str(llama_target), str(out), json.dumps(SPECULATORS_AUX), str(DRAFT_VOCAB)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=engine_env())
    assert proc.returncode == 0 and '{"ok": true}' in proc.stdout, proc.stderr[-3000:]
    assert not (out / "eagle3.json").exists()
    assert json.loads((out / "config.json").read_text())["speculators_version"] == "0.9.0"
    return out


@pytest.fixture(scope="module")
def specforge_checkpoint(tmp_path_factory) -> Path:
    """An EAGLE/SpecForge drafter as SpecForge saves one: midlayer.* (and the target's embed_tokens), a flat Llama
    config with architectures LlamaForCausalLMEagle3 and eagle_config ids in SGLang's convention, no eagle3.json."""
    folder = tmp_path_factory.mktemp("specforge")
    torch.manual_seed(1)
    heads, kv, head_dim, inter = 4, 2, 16, 128
    shapes = {
        "midlayer.input_layernorm.weight": (HIDDEN,),
        "midlayer.hidden_norm.weight": (HIDDEN,),
        "midlayer.post_attention_layernorm.weight": (HIDDEN,),
        "midlayer.self_attn.q_proj.weight": (heads * head_dim, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": (kv * head_dim, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": (kv * head_dim, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": (HIDDEN, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": (inter, HIDDEN),
        "midlayer.mlp.up_proj.weight": (inter, HIDDEN),
        "midlayer.mlp.down_proj.weight": (HIDDEN, inter),
        "fc.weight": (HIDDEN, 3 * HIDDEN),
        "norm.weight": (HIDDEN,),
        "lm_head.weight": (DRAFT_VOCAB, HIDDEN),
        "embed_tokens.weight": (VOCAB, HIDDEN),
    }
    tensors = {name: torch.randn(shape) * 0.02 for name, shape in shapes.items()}
    tensors["d2t"], tensors["t2d"] = build_draft_vocab(torch.randint(0, 1000, (VOCAB,)), DRAFT_VOCAB)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": SPECFORGE_IDS, "use_aux_hidden_state": True},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def run_cli(capsys, *args) -> tuple[int, str, str]:
    rc = cli([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def converted_and_gated(capsys, checkpoint: Path, target: Path, out: Path, aux: list[int]) -> dict:
    """convert --to vllm / sglang --target from the command line, each export's contract checked and passed
    through its engine's gate with no --target (the contract in the export names it). Returns the exports."""
    need_engine("vllm")
    exports = {}
    for engine, counts in (("vllm", "11/11"), ("sglang", "14/14")):
        rc, _, err = run_cli(capsys, "convert", checkpoint, "--to", engine, "--out", out / engine, "--target", target)
        assert rc == 0, err
        contract = json.loads((out / engine / "eagle3.json").read_text())
        assert contract["aux_layer_ids"] == aux
        assert contract["target_fingerprint"] == target_fingerprint(load_config(str(target)))
        assert (contract["target"], contract["hidden_size"], contract["vocab_size"]) == (str(target), HIDDEN, VOCAB)
        assert contract["num_layers"] == LAYERS and contract["draft_vocab_size"] == DRAFT_VOCAB
        assert contract["chat_template_hash"] == chat_template_hash(AutoTokenizer.from_pretrained(target))
        rc, printed, err = run_cli(capsys, "verify", out / engine, "--engine", engine)
        assert rc == 0 and f"{engine} gate: PASS ({counts} loaded" in printed, printed + err
        exports[engine] = out / engine
    return exports


def test_speculators_checkpoint_converts_from_the_command_line(speculators_checkpoint, llama_target, tmp_path, capsys):
    rc, _, err = run_cli(capsys, "convert", speculators_checkpoint, "--to", "vllm", "--out", tmp_path / "x")
    assert rc == 2 and "pass --target TARGET_DIR" in err and "make_contract" not in err, err
    assert f"Its config names the verifier {str(llama_target)!r}" in err
    exports = converted_and_gated(capsys, speculators_checkpoint, llama_target, tmp_path, SPECULATORS_AUX)
    # later steps need no --target: the contract travels with the export
    rc, _, err = run_cli(capsys, "convert", exports["vllm"], "--to", "speculators", "--out", tmp_path / "again")
    assert rc == 0, err
    assert json.loads((tmp_path / "again" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 4, 6]

    # vLLM reads the top-level ids, SGLang eagle_config's: a folder whose copies disagree is refused by the vLLM
    # gate too, though vLLM alone would capture the right layers
    def sglang_copy(c):
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 40, 99]

    bad = edited(exports["vllm"], tmp_path / "disagree", config=sglang_copy)
    rc, printed, err = run_cli(capsys, "verify", bad, "--engine", "vllm")
    assert rc == 1 and "FAIL (11/11 loaded" in printed, printed + err
    assert "two copies of the aux ids disagree" in err and "[2, 40, 99]" in err and "[1, 4, 6]" in err, err


def test_specforge_checkpoint_converts_from_the_command_line(specforge_checkpoint, llama_target, tmp_path, capsys):
    rc, _, err = run_cli(capsys, "verify", specforge_checkpoint, "--engine", "sglang")
    assert rc == 2 and "pass --target TARGET_DIR" in err, err
    converted_and_gated(capsys, specforge_checkpoint, llama_target, tmp_path, [i + 1 for i in SPECFORGE_IDS])


def test_a_target_the_drafter_does_not_fit_is_refused(specforge_checkpoint, tmp_path, capsys):
    """Hidden size, vocabulary, aux ids out of range: refused from convert and verify, naming both sides."""
    cases = {
        "wider": (dict(hidden_size=128), "hidden_size: target", "128, checkpoint 64"),
        "other vocabulary": (dict(vocab_size=32000), "vocab_size: target", "32000, checkpoint 49152"),
        "six layers": (dict(num_hidden_layers=6), "reads target layers [2, 4, 6]", "has 6 layers"),
    }
    for name, (sizes, *words) in cases.items():
        target = target_folder(tmp_path / name.replace(" ", "-"), **sizes)
        for args in (("convert", specforge_checkpoint, "--to", "vllm", "--out", tmp_path / "out"),
                     ("verify", specforge_checkpoint, "--engine", "sglang")):  # fmt: skip
            rc, _, err = run_cli(capsys, *args, "--target", target)
            assert rc == 2 and "does not fit target" in err and all(w in err for w in words), (name, err)
        assert not (tmp_path / "out").exists()


def test_specforge_ids_are_read_per_target_class(specforge_checkpoint, tmp_path):
    """SGLang's ids mean other layers on a DeepSeek-V3 / Kimi-K2.5 target: there, ids not starting at 1 are HF
    indices as they are. The target has no tokenizer: its contract has no chat-template hash."""
    sf = edited(
        specforge_checkpoint,
        tmp_path / "sf",
        config=lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[3, 4, 5]),
    )
    llama = target_folder(tmp_path / "llama")
    deepseek = target_folder(tmp_path / "deepseek", architecture="DeepseekV3ForCausalLM")
    for target, aux in ((llama, [4, 5, 6]), (deepseek, [3, 4, 5])):
        out = layouts.import_checkpoint(sf, tmp_path / f"in-{target.name}", target=target)
        contract = json.loads((out / "eagle3.json").read_text())
        assert contract["aux_layer_ids"] == aux and contract["chat_template_hash"] is None
        assert json.loads((out / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == aux
        sglang = layouts.export(out, "sglang", tmp_path / f"sg-{target.name}")
        assert json.loads((sglang / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
            3,
            4,
            5,
        ]
