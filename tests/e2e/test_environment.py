"""pyproject.toml and environment.yml describe the same environment."""

import re
from pathlib import Path

import tomllib
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def test_environment_yml_agrees_with_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    python = [d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python=")]
    assert python == ["python=3.11"]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    conda_reqs = {Requirement(r).name: Requirement(r) for r in pip}
    wanted = [
        Requirement(r) for r in project["project"]["dependencies"] + project["project"]["optional-dependencies"]["test"]
    ]
    assert sorted(conda_reqs) == sorted(r.name for r in wanted)
    for req in wanted:
        conda = conda_reqs[req.name]
        pinned = [s.version for s in conda.specifier if s.operator == "=="]
        if pinned:  # a pin in environment.yml must satisfy pyproject's range
            assert req.specifier.contains(pinned[0]), (req, conda)
        else:
            assert conda.specifier == req.specifier, (req, conda)
    # The embedded target's package goes in with --no-deps in both.
    tool = project["tool"]["eagle3-workbook"]
    text = (ROOT / "environment.yml").read_text()
    for req in tool["install-no-deps"]:
        assert re.search(rf"pip install --no-deps {re.escape(req)}", text), req
    assert tool["cpu-torch"] in pip
    makefile = (ROOT / "Makefile").read_text()
    assert f"pip install -q {tool['cpu-torch']}" in makefile
    no_deps = [line for line in makefile.splitlines() if "pip install" in line and "--no-deps" in line]
    for req in tool["install-no-deps"]:
        assert any(req in line.split() for line in no_deps), (req, no_deps)
