"""The library stays readable top to bottom: in eagle3lib/ no function is longer than about 80 lines and no module
longer than about 400 (docs/design.md §2). A part that outgrows them has grown a second idea."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "eagle3lib"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 400


def files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def long_functions(path: Path, limit: int) -> list[str]:
    """'name (lines)' of every function or method in the file longer than limit lines, nested ones too."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{node.name} at line {node.lineno} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > limit
    ]


@pytest.mark.parametrize("path", files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_functions_and_modules_fit_a_few_screens(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines: split it by concern"
    assert not long_functions(path, MAX_FUNCTION_LINES), f"{path.relative_to(PACKAGE)}: split these functions"


def test_the_function_counter_sees_a_long_method(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(81))
    f = tmp_path / "m.py"
    f.write_text(f"class A:\n    def long(self):\n{body}\n\n    def short(self):\n        return 1\n")
    assert long_functions(f, MAX_FUNCTION_LINES) == ["long at line 2 (82 lines)"]
