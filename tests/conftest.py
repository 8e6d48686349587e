import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported (docs/design.md §3)

import pytest

ROOT = Path(__file__).resolve().parent.parent


# ---- Kimi-K2.5's published files (../shared, beside the checkout; never copied into the project) ----------
KIMI_FIXTURES = ROOT.parent / "shared" / "fixtures" / "kimi-k2.5"


@pytest.fixture(scope="session")
def kimi_fixtures() -> Path:
    if not (KIMI_FIXTURES / "tiktoken.model").is_file():
        pytest.skip(f"Kimi-K2.5's files are not at {KIMI_FIXTURES} (../shared/fixtures/kimi-k2.5 beside the checkout)")
    return KIMI_FIXTURES


@pytest.fixture(scope="session")
def kimi_folder(kimi_fixtures, tmp_path_factory) -> Path:
    """A model folder as a Kimi-K2.5 download has it, without the weights: config.json, tiktoken.model, the
    chat template, and K2-Instruct's tokenizer_config.json (K2.5's was not published verbatim; same tokens)."""
    folder = tmp_path_factory.mktemp("kimi-k2.5")
    for name in ("config.json", "tiktoken.model", "chat_template.jinja"):
        (folder / name).symlink_to(kimi_fixtures / name)
    (folder / "tokenizer_config.json").symlink_to(kimi_fixtures / "k2-instruct" / "tokenizer_config.json")
    return folder


# ---- embedded target fixtures (used by test_target.py and test_data.py) -------------------
@pytest.fixture(scope="session")
def embedded_cache(tmp_path_factory):
    """A fresh cache dir with the embedded SmolLM2 converted once for the session (~25 s)."""
    from eagle3lib.target import embedded_target_dir

    cache = tmp_path_factory.mktemp("target-cache")
    return cache, embedded_target_dir(cache)


@pytest.fixture(scope="session")
def embedded_target(embedded_cache):
    """(model fp32 eval, tokenizer) of the embedded target, loaded from the session cache."""
    from eagle3lib.target import EMBEDDED_TARGET, load_target

    return load_target(EMBEDDED_TARGET, embedded_cache[0])


@pytest.fixture(scope="module")
def small_target(embedded_cache):
    """(model, tokenizer): a small random Llama (6 layers, hidden 64, vocab 256) whose sharp next-token distribution
    gives a drafter something to learn, with the embedded target's tokenizer (its chat template enters contracts)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    # a sharp next-token distribution, as trained models have, gives the drafter something to learn
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    tokenizer = AutoTokenizer.from_pretrained(embedded_cache[1])  # only its chat template enters the contract
    return model, tokenizer


def need_engine(engine: str) -> str:
    """The engine's interpreter (.venv-vllm, .venv-sglang). Missing: a skip that says how to build it, or, under
    CI (CI set, as .ci/run sets it), a failure: CI builds both, so a missing one is a broken set-up."""
    from eagle3lib.engines.interpreter import engine_python

    py = engine_python(engine)
    if py is None:
        message = f"no .venv-{engine}: run `make {engine}-env`"
        if os.environ.get("CI"):
            pytest.fail(f"{message} (CI builds it: the set-up failed)")
        pytest.skip(message)
    return py


@pytest.fixture
def sglang_engine():
    return need_engine("sglang")


@pytest.fixture
def vllm_engine():
    return need_engine("vllm")


# The engines' fast start for tests that judge correctness, not speed: no torch.compile warm-up (~40 s to ready
# instead of ~150-200 s on 2 cores).
FAST_START = ["--enforce-eager"]


@pytest.fixture(scope="session")
def learned(embedded_target):
    """The real target, two chat prompts with their greedy continuations, and a tiny drafter that has learned the
    first continuation (80 TTT steps on it): served, its drafts are accepted only if it gets the right aux states."""
    from drafters import learned_drafter

    return learned_drafter(*embedded_target)


# ---- end of embedded target fixtures --------------------------------------------------------


# ---- the ci run (test_e2e.py, test_browser.py, test_lab.py) ---------------------------------
@pytest.fixture(scope="session")
def ci_run(tmp_path_factory, embedded_cache):
    """The whole pipeline on tests/params/ci.yaml, once per session (several minutes on 2 cores):
    (run folder, the overrides it ran with)."""
    from eagle3lib.workbook import pipeline

    out_root = tmp_path_factory.mktemp("outputs")
    overrides = {"run.output_root": str(out_root), "run.cache_dir": str(embedded_cache[0])}
    run_dir = pipeline.run_pipeline(ROOT / "tests" / "params" / "ci.yaml", overrides, log_output=False)
    return run_dir, overrides


def pytest_collection_modifyitems(config, items):
    """tests/gpu (marker `gpu`) needs a CUDA device: each such test skips with its reason where torch sees none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (tests/gpu); torch sees none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
