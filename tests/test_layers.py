"""The library's layers, read from its imports (every import statement, function-level ones included).

    __main__ (the CLI) -> workbook -> stages -> engines -> base -> engines/inside

Stages are prepare, extract, train, convert, deploy, bench; a stage may import the stages before it in the pipeline
(train reads extract's shards), never one after it. The base modules (params, target, drafter, ttt_attention, vocab, run_folder,
the package itself) import no stage, engine or workbook module. engines/inside runs in an engine's own
interpreter: the standard library, torch, safetensors and the engine it serves only, nothing of eagle3lib.
"""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "eagle3lib"
STAGES = ("prepare", "extract", "train", "convert", "deploy", "bench")  # pipeline order
BASE = ("__init__", "params", "target", "drafter", "ttt_attention", "drafter_formats", "vocab", "run_folder",
        "hardware", "aux_ids", "tiny_target", "tiktoken_tokenizer", "tool_declarations")  # fmt: skip
# Known imports against the layers, each with why it is still there; empty when there are none.
ALLOWED: set[tuple[str, str]] = set()


def modules() -> dict[str, Path]:
    """{dotted module name: file} of every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file; `from eagle3lib import x` names the module x when
    x is one, relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in MODULES else base, node.lineno))
    return found


def layer(name: str) -> tuple[int, int]:
    """(layer, order within it) of an eagle3lib module; higher layers may import lower ones."""
    parts = name.split(".")[1:] or ["__init__"]
    if parts[0] == "__main__":
        return 5, 0
    if parts[0] == "workbook":
        return 4, 0
    if parts[0] in STAGES:
        return 3, STAGES.index(parts[0])
    if parts[:2] == ["engines", "inside"]:
        return 0, 0
    if parts[0] == "engines":
        return 2, 0
    if parts[0] in BASE:
        return 1, 0
    raise AssertionError(f"eagle3lib.{'.'.join(parts)}: no layer; add it to tests/test_layers.py")


def what(name: str) -> str:
    """The layer in words, for the failure message."""
    rank, order = layer(name)
    return ["engines/inside", "base", "engines", f"stage {STAGES[order]}", "workbook", "CLI"][rank]


def owner(name: str) -> str:
    """The folder (or base module) a module belongs to: imports within it are free."""
    parts = name.split(".")
    return ".".join(parts[:4]) if parts[1:3] == ["engines", "inside"] else ".".join(parts[:2])


def test_every_module_has_a_layer():
    for name in MODULES:
        layer(name)


def test_no_module_imports_upward():
    wrong = []
    for name, path in MODULES.items():
        for target, line in imports(name, path):
            if not target.startswith("eagle3lib") or owner(target) == owner(name):
                continue
            if layer(target) > layer(name) or layer(name)[0] == 0:
                where = f"{path.relative_to(PACKAGE.parent)}:{line}"
                if (name, target) not in ALLOWED:
                    wrong.append(f"{where}: {name} ({what(name)}) imports {target} ({what(target)})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def engine_side_allowed(stem: str) -> set[str]:
    """What a module of engines/inside may import besides the standard library: torch, safetensors and the
    engine it serves (vllm_* vLLM, sglang_* SGLang; load_check serves both gates). guard.py, which any
    interpreter runs, the standard library only."""
    if stem == "guard":
        return set()
    engines = {"vllm", "sglang"} if stem == "load_check" else {stem.split("_")[0]} & {"vllm", "sglang"}
    assert engines or stem == "__init__", f"engines/inside/{stem}.py: name it after the engine it serves"
    return {"torch", "safetensors"} | engines


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("engines/inside/*.py")) + [PACKAGE / "engines" / "guard.py"])
def test_engine_side_code_imports_only_what_the_engine_has(path):
    allowed = engine_side_allowed(path.stem) | set(sys.stdlib_module_names)
    found = {target.split(".")[0]: line for target, line in imports(path.stem, path)}
    wrong = {top: line for top, line in found.items() if top not in allowed}
    assert not wrong, f"{path.name} imports {wrong} (module: line); it runs in an engine's interpreter"


def test_the_reader_sees_every_kind_of_import(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text(
        "import json\nfrom eagle3lib import engines, params as P\n"
        "def f():\n    from eagle3lib.convert.layouts import export\n    from . import shards\n"
    )
    found = [target for target, _ in imports("eagle3lib.extract.mod", path)]
    assert found == [
        "json",
        "eagle3lib.engines",
        "eagle3lib.params",
        "eagle3lib.convert.layouts",
        "eagle3lib.extract.shards",
    ]
    assert layer("eagle3lib.extract.mod") < layer("eagle3lib.convert.layouts")  # extract may not import convert
