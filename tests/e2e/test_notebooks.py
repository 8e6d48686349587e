"""Stage notebooks: committed without outputs, thin (one import cell, calls, tables and plots), with a papermill
parameters cell."""

import ast
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_stage_notebooks():
    assert [p.stem for p in NOTEBOOKS][:2] == ["00_prepare", "01_extract"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: strip outputs before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_parameters_cell(path):
    nb = nbformat.read(path, as_version=4)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: exactly one cell tagged 'parameters'"
    for name in ("params_file", "run_dir", "overrides"):
        assert f"{name} =" in tagged[0].source
    assert nb.metadata["kernelspec"]["name"] == "python3"


# Statements that are logic, not calls, tables and plots (a `with` that stops a server is a call's scope).
LOGIC = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.For, ast.AsyncFor, ast.While, ast.If, ast.Try)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_thin(path):
    """Logic lives in eagle3lib: no definitions, loops or conditionals in notebooks; one cell imports, and
    it opens the stage (eagle3lib, imported by it, sets OMP_WAIT_POLICY before anything imports torch)."""
    nb = nbformat.read(path, as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code" and "parameters" not in c.metadata.get("tags", [])]
    for source in code:
        logic = [type(n).__name__ for n in ast.walk(ast.parse(source)) if isinstance(n, LOGIC)]
        assert not logic, f"{path.name}: {logic} in a cell; move it into eagle3lib:\n{source}"
    importing = [s for s in code if any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(ast.parse(s)))]
    assert len(importing) == 1 and f'open_stage("{path.stem}", params_file, run_dir, overrides)' in importing[0]
    assert not re.search(r"^(from|import) (torch|transformers)\b", importing[0], re.M), path.name
