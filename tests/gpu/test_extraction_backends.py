"""SGLang's extraction backends against hf on the same tokens, on a GPU (benchmarks/capture_check.py): the per-layer
differences and the layer probe (an off-by-one in the aux ids shows there). The in-process backend runs in SGLang's
environment (.venv-sglang, benchmarks/gpu_host/setup.sh); the target is a random-weight Llama of SmolLM2's config.

    .venv/bin/python -m pytest tests/gpu/test_extraction_backends.py
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = Path(os.environ.get("SGLANG_PYTHON", ROOT / ".venv-sglang" / "bin" / "python"))
FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.3"]


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    if not SGLANG_PYTHON.exists():
        pytest.skip(f"no SGLang environment at {SGLANG_PYTHON} (benchmarks/gpu_host/setup.sh makes it)")
    work = tmp_path_factory.mktemp("capture-check")
    tokens = work / "tokens.safetensors"
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    save = [sys.executable, "-m", "benchmarks.capture_check", "save-tokens", str(tokens), "--n", "64"]
    subprocess.run(save, cwd=ROOT, env=env, check=True)
    target = work / "target"
    subprocess.run(
        [sys.executable, "-m", "benchmarks.capture_check", "random-target", str(target)], cwd=ROOT, env=env, check=True
    )
    return work, tokens, target, env


@pytest.mark.parametrize("backend", ["inprocess", "sglang"])
def test_the_backend_agrees_with_hf(checked, backend):
    work, tokens, target, env = checked
    out = work / backend
    cmd = [
        str(SGLANG_PYTHON),
        "-m",
        "benchmarks.capture_check",
        backend,
        "--target",
        str(target),
        "--tokens",
        str(tokens),
    ]
    cmd += ["--n", "24", "--out", str(out), "--dtype", "bfloat16"]
    cmd += (
        ["--", *FLAGS]
        if backend == "inprocess"
        else ["--engine-python", str(SGLANG_PYTHON), "--extra-args", " ".join(FLAGS)]
    )
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads((out / "compare.json").read_text())["ok"]
