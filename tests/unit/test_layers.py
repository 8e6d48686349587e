"""The library's layers, read from its imports (every import statement, function-level ones included).

    __main__ (the CLI) -> workbook -> stages -> engines -> base -> engines/engine_side

Stages are prepare, extract, train, convert, deploy, speedup; a stage may import the stages before it in the pipeline
(train reads extract's shards), never one after it. The base (params, run_folder, hardware, the package itself, and
the drafter/ and target/ folders) imports no stage, engine or workbook module. engines/engine_side runs in an engine's own
interpreter: the standard library, torch, safetensors and the engine it serves only, nothing of eagle3lib.
A module of eagle3lib that engines.interpreter.run_module starts in an engine's interpreter (01_extract's
sglang_inprocess command; online training's stage in SGLang's interpreter), and every eagle3lib module it imports,
transitively, import neither the workbook (workbook/, __main__) nor the workbook's notebook and plotting packages
(WORKBOOK_ONLY): an engine's environment carries torch, transformers, safetensors and the engine, not those.
No two modules of eagle3lib/ or benchmarks/ import each other, directly or around a circle.
"""

import ast
import graphlib
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "eagle3lib"
STAGES = ("prepare", "extract", "train", "convert", "deploy", "speedup")  # pipeline order
BASE = ("__init__", "params", "run_folder", "hardware", "drafter", "target")
MAX_TOP_MODULES = 8  # modules directly under eagle3lib/: the rest lives in the folder of its stage or part
# Known imports against the layers, each with why it is still there; empty when there are none.
ALLOWED: set[tuple[str, str]] = set()
# The packages only the workbook's own environment has (the notebooks' runner and kernel, widgets, plots).
WORKBOOK_ONLY = {"papermill", "nbconvert", "nbformat", "nbclient", "ipykernel", "ipywidgets", "IPython"}
WORKBOOK_ONLY |= {"jupyter", "jupyterlab", "matplotlib"}


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """{dotted module name: file} of every module of the package."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def imports(name: str, path: Path, known: dict[str, Path] = MODULES) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file; `from eagle3lib import x` names the module x when
    x is one of `known`, relative imports resolved."""
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
                found.append((sub if sub in known else base, node.lineno))
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
    if parts[:2] == ["engines", "engine_side"]:
        return 0, 0
    if parts[0] == "engines":
        return 2, 0
    if parts[0] in BASE:
        return 1, 0
    raise AssertionError(f"eagle3lib.{'.'.join(parts)}: no layer; add it to tests/unit/test_layers.py")


def what(name: str) -> str:
    """The layer in words, for the failure message."""
    rank, order = layer(name)
    return ["engines/engine_side", "base", "engines", f"stage {STAGES[order]}", "workbook", "CLI"][rank]


def owner(name: str) -> str:
    """The folder (or base module) a module belongs to: imports within it are free."""
    parts = name.split(".")
    return ".".join(parts[:4]) if parts[1:3] == ["engines", "engine_side"] else ".".join(parts[:2])


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


def circles(known: dict[str, Path]) -> list[str]:
    """An import circle among `known` (module names, one after the other, back to the first), or []. A module's
    import of its own package (its __init__) is no edge: Python runs the package first anyway."""
    graph = {
        name: {t for t, _ in imports(name, path, known) if t in known and t != name and not name.startswith(t + ".")}
        for name, path in known.items()
    }
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return e.args[1]
    return []


@pytest.mark.parametrize("folder", ["eagle3lib", "benchmarks"])
def test_no_import_circles(folder):
    circle = circles(modules(PACKAGE.parent / folder))
    assert not circle, "import circle: " + " -> ".join(circle) + "; move the shared name down to a module both import"


def test_the_circle_finder_sees_a_circle(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "__init__.py").write_text("from pkg.sub.b import x\n")  # a package's own __init__: no edge
    (package / "sub" / "b.py").write_text("import pkg.sub\ndef f():\n    from pkg import a\n")
    assert set(circles(modules(package))) == {"pkg.a", "pkg.sub.b"}
    (package / "sub" / "b.py").write_text("import pkg.sub\n")
    assert circles(modules(package)) == []


def test_few_modules_directly_under_the_package():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules directly under eagle3lib/ ({top}): put them in a folder"


ENGINE_SIDE = sorted(PACKAGE.glob("engines/engine_side/*.py"))


def served_engines(stem: str) -> set[str]:
    """The engines a module of engines/engine_side serves: vllm_* vLLM, sglang_* SGLang, speculators_* speculators'
    own library; load_check both engines' gates; report (the answer's JSON line, standard library only) none."""
    engines = {"vllm", "sglang"} if stem == "load_check" else {stem.split("_")[0]} & {"vllm", "sglang", "speculators"}
    assert engines or stem in ("__init__", "report"), (
        f"engines/engine_side/{stem}.py: name it after the engine it serves"
    )
    return engines


def engine_side_allowed(stem: str) -> set[str]:
    """What a module of engines/engine_side may import besides the standard library: torch, safetensors, the engine
    it serves, and a sibling module of the folder serving no other engine (the scripts run as files, and Python puts
    a script's own folder first on sys.path). guard.py, which any interpreter runs, the standard library only."""
    if stem == "guard":
        return set()
    engines = served_engines(stem)
    siblings = {p.stem for p in ENGINE_SIDE if p.stem not in ("__init__", stem) and served_engines(p.stem) <= engines}
    return {"torch", "safetensors"} | engines | siblings


@pytest.mark.parametrize("path", ENGINE_SIDE + [PACKAGE / "engines" / "guard.py"])
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


def string_constants(known: dict[str, Path]) -> dict[str, str]:
    """{NAME: value} of every module-level `NAME = "eagle3lib..."` of the package (a module named by a constant)."""
    found = {}
    for path in known.values():
        for node in ast.parse(path.read_text(), str(path)).body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                for t in node.targets:
                    if isinstance(t, ast.Name) and node.value.value.startswith("eagle3lib"):
                        found[t.id] = node.value.value
    return found


def run_in_engines(known: dict[str, Path] = MODULES) -> dict[str, str]:
    """{module: where} of every eagle3lib module a run_module call starts: its module argument as a string, a
    constant that names one, or __name__ (the calling module itself)."""
    constants, found = string_constants(known), {}
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            func = getattr(node, "func", None)
            if getattr(func, "id", getattr(func, "attr", None)) != "run_module":
                continue
            arg = node.args[1] if len(node.args) > 1 else next(k.value for k in node.keywords if k.arg == "module")
            if isinstance(arg, ast.Constant):
                module = arg.value
            elif isinstance(arg, ast.Name):
                module = name if arg.id == "__name__" else constants[arg.id]
            else:
                raise AssertionError(f"{path}:{node.lineno}: run_module's module is neither a string nor a constant")
            found[module] = f"{name}:{node.lineno}"
    return found


def imported_from(entry: str, known: dict[str, Path] = MODULES) -> dict[str, str]:
    """{module: the module that imports it} of `entry` and every module of `known` it imports, transitively
    (function-level imports included; a module's packages with it: importing a.b.c runs a and a.b)."""
    seen, todo = {entry: entry}, [entry]
    while todo:
        name = todo.pop()
        for target, _ in imports(name, known[name], known):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                module = ".".join(parts[:i])
                if module in known and module not in seen:
                    seen[module] = name
                    todo.append(module)
    return seen


def test_modules_run_in_an_engines_interpreter_import_no_workbook_part():
    entries = run_in_engines()
    # 01_extract's sglang_inprocess command (SGLangInProcess) and online training's stage (the sglang_inprocess thread)
    assert {"eagle3lib.extract.sglang_inprocess_extract", "eagle3lib.train.runtime.launch"} <= set(entries), entries
    wrong = []
    for entry, where in entries.items():
        for name, via in imported_from(entry).items():
            if layer(name)[0] >= 4:
                wrong.append(f"{entry} (started at {where}) imports {name} ({what(name)}) through {via}")
            for target, line in imports(name, MODULES[name]):
                if target.split(".")[0] in WORKBOOK_ONLY:
                    at = f"{MODULES[name].relative_to(PACKAGE.parent)}:{line}"
                    wrong.append(f"{at}: {name} imports {target}, and {entry} (started at {where}) imports it")
    assert not wrong, "modules that run in an engine's interpreter import the workbook's parts:\n" + "\n".join(wrong)


def test_the_engine_side_finder_follows_run_module_and_imports(tmp_path):
    package = tmp_path / "eagle3lib"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "names.py").write_text('ENTRY = "eagle3lib.sub.entry"\n')
    (package / "launch.py").write_text(
        "from eagle3lib.names import ENTRY\nfrom eagle3lib.engines.interpreter import run_module\n"
        "def go(py):\n    run_module(py, ENTRY, [], 'log')\n    run_module(py, __name__, [], 'log')\n"
    )
    (package / "sub" / "entry.py").write_text("def f():\n    from eagle3lib.sub import helper\n")
    (package / "sub" / "helper.py").write_text("import matplotlib\n")
    known = modules(package)
    assert set(run_in_engines(known)) == {"eagle3lib.sub.entry", "eagle3lib.launch"}
    assert imported_from("eagle3lib.sub.entry", known) == {
        "eagle3lib.sub.entry": "eagle3lib.sub.entry",
        "eagle3lib": "eagle3lib.sub.entry",
        "eagle3lib.sub": "eagle3lib.sub.entry",
        "eagle3lib.sub.helper": "eagle3lib.sub.entry",
    }


def underscore_uses(name: str, path: Path, known: dict[str, Path] = MODULES) -> list[str]:
    """'line: module._name' for every underscore name of another eagle3lib module this one imports or reads
    (`from eagle3lib.m import _x`, or `m._x` where m names an eagle3lib module here)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    aliases, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in known})
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            for a in node.names:
                if f"{base}.{a.name}" in known:
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
                elif base in known and base != name and a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{node.lineno}: {base}.{a.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{node.lineno}: {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_module_reads_another_ones_underscore_names():
    wrong = [
        f"{path.relative_to(PACKAGE.parent)}:{use}"
        for name, path in MODULES.items()
        for use in underscore_uses(name, path)
    ]
    assert not wrong, "underscore names are their module's own; make the name public or move it:\n" + "\n".join(wrong)


def test_the_underscore_reader_sees_both_forms(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("_x = 1\ndef _f():\n    pass\n")
    (package / "b.py").write_text("from pkg import a\nfrom pkg.a import _x\n\nprint(a._f, a.__name__, _x)\n")
    known = modules(package)
    assert underscore_uses("pkg.b", package / "b.py", known) == ["2: pkg.a._x", "4: pkg.a._f"]
    assert underscore_uses("pkg.a", package / "a.py", known) == []
