"""docs/design.md §2's module map equals eagle3lib/'s files: the tree lists the modules at the package's root, and
one bullet per folder (- `train/sources/`: ...) names each of its modules in backticks. A package's `__init__.py`
is named where it holds more than its docstring (a public API, a dispatch)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "eagle3lib"
DESIGN = ROOT / "docs" / "design.md"


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
