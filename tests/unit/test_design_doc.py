"""The docs stay true to the tree and short enough to read. docs/design.md §2's module map equals eagle3lib/'s files:
the tree lists the modules at the package's root, and one bullet per folder (- `train/sources/`: ...) names each of
its modules in backticks; a package's `__init__.py` is named where it holds more than its docstring (a public API, a
dispatch). Every params file the docs or README.md name exists, docs/cli.md lists every params file, every `make X`
they name is a Makefile target, and docs/ keeps to its line width, design.md's length and its word budget."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "eagle3lib"
DOCS = ROOT / "docs"
DESIGN = DOCS / "design.md"
MAX_LINE = 120
MAX_DESIGN_LINES = 350
MAX_DOCS_WORDS = 6500
# a params file as prose names it: params/NAME.yaml or tests/params/NAME.yaml, not part of a longer path
PARAMS_FILE = re.compile(r"(?<![\w./-])((?:tests/)?params/[\w.-]+\.ya?ml)\b")
# the file a reader is asked to write for a model of their own (params/my-model.yaml) is an example, not a recipe
PLACEHOLDER = "my-"
# `make X` in inline code, or a fenced code line that starts with make X
MAKE_INLINE = re.compile(r"`make ([\w.-]+)[^`]*`")
MAKE_FENCED = re.compile(r"^\s*make ([\w.-]+)")
MAKE_TARGET = re.compile(r"^([\w.-]+(?:[ \t]+[\w.-]+)*)[ \t]*:(?!=)", re.MULTILINE)


def layout_section(text: str) -> str:
    start = text.index("## 2. Layout")
    return text[start : text.index("\n## ", start + 1)]


def mapped_modules(text: str) -> dict[str, set[str]]:
    """{folder relative to eagle3lib/ ('' for the root): module file names the map gives it}."""
    section = layout_section(text)
    tree = section[section.index("```") : section.index("```", section.index("```") + 3)]
    in_package = tree[tree.index("eagle3lib/") :].split("\n")[1:]
    root = set()
    for line in in_package:
        if not line.startswith("  "):  # the tree's next top-level entry: the package's listing ended
            break
        name = line.split()[0]
        if name.endswith(".py"):
            root.add(name)
    found = {"": root}
    bullets = re.split(r"\n(?=- )|\n\n", section[section.index("```", section.index("```") + 3) :])
    for bullet in bullets:
        head = re.match(r"- `([\w/]+)/`", bullet)
        if head:
            found[head.group(1)] = set(re.findall(r"`(\w+\.py)`", bullet))
    return found


def holds_code(init: Path) -> bool:
    """Whether a package's __init__.py holds a statement besides its docstring."""
    body = ast.parse(init.read_text()).body
    return any(not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) for node in body)


def package_modules(package: Path = PACKAGE) -> dict[str, set[str]]:
    found = {}
    for folder in [package, *sorted(p for p in package.rglob("*") if p.is_dir() and (p / "__init__.py").is_file())]:
        files = {f.name for f in folder.glob("*.py") if f.name != "__init__.py" or holds_code(f)}
        found["" if folder == package else str(folder.relative_to(package))] = files
    return found


def test_the_module_map_lists_every_module_and_no_other():
    mapped, actual = mapped_modules(DESIGN.read_text()), package_modules()
    problems = []
    for folder in sorted(set(mapped) | set(actual)):
        where = f"eagle3lib/{folder + '/' if folder else ''}"
        missing, extra = (
            actual.get(folder, set()) - mapped.get(folder, set()),
            mapped.get(folder, set()) - actual.get(folder, set()),
        )
        if folder not in mapped:
            problems.append(f"{where}: no bullet `- \\`{folder}/\\`: ...` in docs/design.md §2")
        elif missing:
            problems.append(f"{where}: not in the map: {sorted(missing)}")
        if extra:
            problems.append(f"{where}: in the map but not on disk: {sorted(extra)}")
    assert not problems, "docs/design.md §2's module map is behind the code:\n" + "\n".join(problems)


def test_the_map_reader_sees_a_missing_module(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    for f in ("pkg/__init__.py", "pkg/a.py", "pkg/sub/__init__.py", "pkg/sub/b.py", "pkg/sub/c.py"):
        (tmp_path / f).write_text('"""doc"""\n')
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text('"""doc"""\nX = 1\n')
    text = "## 2. Layout\n```\neagle3lib/\n  a.py   the a\ndocs/\n```\n- `sub/`: `b.py` (the b).\n## 3. Next\n"
    assert mapped_modules(text) == {"": {"a.py"}, "sub": {"b.py"}}
    assert package_modules(tmp_path / "pkg") == {"": {"a.py"}, "sub": {"__init__.py", "b.py", "c.py"}}


def prose_files() -> list[Path]:
    return [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]


def named_params_files(text: str) -> set[str]:
    return set(PARAMS_FILE.findall(text))


def named_make_targets(text: str) -> set[str]:
    found, fenced = set(MAKE_INLINE.findall(text)), False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced and (m := MAKE_FENCED.match(line)):
            found.add(m.group(1))
    return found


def makefile_targets(text: str) -> set[str]:
    targets = set()
    for m in MAKE_TARGET.finditer(text):
        targets |= {name for name in m.group(1).split() if not name.startswith(".")}
    return targets


def test_every_params_file_the_docs_name_exists():
    missing = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in prose_files()
        for name in sorted(named_params_files(path.read_text()))
        if not (ROOT / name).is_file() and not Path(name).name.startswith(PLACEHOLDER)
    ]
    assert not missing, "params files named but not on disk:\n" + "\n".join(missing)


def test_cli_md_lists_every_params_file():
    listed = named_params_files((DOCS / "cli.md").read_text())
    on_disk = {str(p.relative_to(ROOT)) for d in ("params", "tests/params") for p in sorted((ROOT / d).glob("*.yaml"))}
    assert not on_disk - listed, f"docs/cli.md does not list: {sorted(on_disk - listed)}"


def test_every_make_target_the_docs_name_exists():
    targets = makefile_targets((ROOT / "Makefile").read_text())
    unknown = [
        f"{path.relative_to(ROOT)}: make {name}"
        for path in prose_files()
        for name in sorted(named_make_targets(path.read_text()) - targets)
    ]
    assert not unknown, "not a Makefile target:\n" + "\n".join(unknown)


def test_docs_lines_fit_the_width():
    long = [
        f"{path.relative_to(ROOT)}:{n} ({len(line)} characters)"
        for path in sorted(DOCS.glob("*.md"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if len(line) > MAX_LINE
    ]
    assert not long, f"lines over {MAX_LINE} characters:\n" + "\n".join(long)


def test_the_docs_stay_short():
    lines = len(DESIGN.read_text().splitlines())
    assert lines <= MAX_DESIGN_LINES, (
        f"docs/design.md has {lines} lines (at most {MAX_DESIGN_LINES}): move figures to results"
    )
    words = {p.name: len(p.read_text().split()) for p in sorted(DOCS.glob("*.md"))}
    assert sum(words.values()) <= MAX_DOCS_WORDS, (
        f"docs/ has {sum(words.values())} words (at most {MAX_DOCS_WORDS}): {words}"
    )


def test_the_readers_see_names_and_targets():
    text = "Run `params/a.yaml`, tests/params/b.yml and benchmarks/params/c.yaml.\n`make run PARAMS=x`\n```\nmake lab\n```\n"
    assert named_params_files(text) == {"params/a.yaml", "tests/params/b.yml"}
    assert named_make_targets(text) == {"run", "lab"}
    makefile = ".PHONY: run lab\nrun: setup\n\tx\nPY ?= python\nA := 1\nvllm-env sglang-env: b\n"
    assert makefile_targets(makefile) == {"run", "vllm-env", "sglang-env"}
