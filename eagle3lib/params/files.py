"""Reading params files: UTF-8 YAML holding a mapping of sections, and the `base:` chain a recipe stands on.

A recipe may name its base (`base: smollm2-135m-cpu.yaml`, a path relative to the recipe): the base is read the
same way, recursively, and the recipe merged over it, mappings key by key, lists and scalars replaced whole. A
base's relative paths keep meaning what they meant in the base, resolved against the base's own folder; its
run.name stays its own (a run's name is the recipe's, by default its file's stem), so two recipes never share a
run folder by inheritance.
"""

from __future__ import annotations

from pathlib import Path

import yaml

BASE_KEY = "base"
# bench.prompts entries that are files, not named sets (speedup/prompt_sets.py reads them)
PROMPT_FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json")


class ParamsError(ValueError):
    """A params file that does not read or validate; the message names the file and lists every problem."""


def read_mapping(path: Path) -> dict:
    """The top-level mapping of one params file (base: included); refused, naming the file, when it is not UTF-8
    text, not YAML (with YAML's line) or not a mapping."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ParamsError(
            f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} on line {line}); save the file as UTF-8"
        ) from None
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ParamsError(f"{path}: not valid YAML{where}: {problem}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ParamsError(f"{path}: expected a mapping of sections at the top level, found {type(tree).__name__}")
    return tree


def deep_merge(base: dict, over: dict) -> dict:
    """over merged onto base: a mapping in both merges key by key; anything else (lists, scalars) is over's."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_recipe(path: Path) -> tuple[dict, list[Path]]:
    """The tree of the params file at path merged over its bases (base: removed), and the files read, the recipe
    first and its root base last."""
    return _read_chain(path.resolve(), [])


def read_base(path: Path) -> tuple[dict, list[Path]]:
    """What the params file at path stands on: its bases' merged tree ({} without base:), and the base files read."""
    path = path.resolve()
    own = read_mapping(path)
    base_file = _base_file(path, own)
    if base_file is None:
        return {}, []
    return _base_tree(base_file, [path])


def _read_chain(path: Path, seen: list[Path]) -> tuple[dict, list[Path]]:
    if path in seen:
        cycle = " -> ".join(str(f) for f in [*seen[seen.index(path) :], path])
        raise ParamsError(f"base: the params files name each other in a circle: {cycle}")
    own = read_mapping(path)
    base_file = _base_file(path, own)
    own.pop(BASE_KEY, None)
    if base_file is None:
        return own, [path]
    base, files = _base_tree(base_file, [*seen, path])
    return deep_merge(base, own), [path, *files]


def _base_file(path: Path, own: dict) -> Path | None:
    """The base file path's mapping names (None without base:), refused when it is not a file's path or no file."""
    if BASE_KEY not in own:
        return None
    name = own[BASE_KEY]
    if not isinstance(name, str) or not name.strip():
        raise ParamsError(f"{path}: base: expected the path of a params file, got {name!r}")
    base_file = (path.parent / Path(name).expanduser()).resolve()
    if not base_file.is_file():
        raise ParamsError(
            f"{path}: base: no params file at {base_file} (a base's path is relative to the recipe's folder)"
        )
    return base_file


def _base_tree(base_file: Path, seen: list[Path]) -> tuple[dict, list[Path]]:
    """The base's merged tree with its relative paths made absolute against its folder, and without run.name."""
    tree, files = _read_chain(base_file, seen)
    tree = absolute_paths(tree, base_file.parent)
    if isinstance(tree.get("run"), dict):
        tree["run"] = {k: v for k, v in tree["run"].items() if k != "name"}
    return tree, files


# ------------------------------------------------------------------------------ paths ----
# A relative path in a params file is relative to that file's folder. The final params resolve theirs in
# loading.resolve_paths; a base's are resolved here, before the recipe's tree is merged over them.


def where(value: str, folder: Path) -> str:
    """A place that may be a path or a name: `embedded:...` and hub ids ("org/name") stay as they are, a path
    (starting with '.' or naming something that exists) is made absolute; `tiny:` wraps either."""
    if value.startswith("tiny:"):  # a tiny copy of the model at this folder (or hub id)
        return "tiny:" + where(value.removeprefix("tiny:"), folder)
    if value.startswith("embedded:") or Path(value).is_absolute():
        return value
    candidate = (folder / value).resolve()
    return str(candidate) if (value.startswith(".") or candidate.exists()) else value


def file_path(value: str, folder: Path, expand_user: bool = True) -> str:
    """A path, absolute (~ expanded unless expand_user is off)."""
    return str((folder / (Path(value).expanduser() if expand_user else Path(value))).resolve())


def absolute_paths(tree: dict, folder: Path) -> dict:
    """A copy of a raw params tree with its relative paths resolved against folder; values of the wrong type are
    left for validation to name."""
    tree = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}

    def each(section: str, key: str, fix) -> None:
        node = tree.get(section)
        if not isinstance(node, dict) or key not in node:
            return
        value = node[key]
        if isinstance(value, str):
            node[key] = fix(value)
        elif isinstance(value, list):
            node[key] = [fix(v) if isinstance(v, str) else v for v in value]

    each("run", "output_root", lambda v: file_path(v, folder, expand_user=False))
    each("run", "cache_dir", lambda v: file_path(v, folder))
    each("target", "name", lambda v: where(v, folder))
    each("data", "sources", lambda v: where(v, folder))
    each("data", "keep_unseen", lambda v: file_path(v, folder, expand_user=False))
    each("train", "init_from", lambda v: file_path(v, folder))
    each("engine", "python", lambda v: where(v, folder))
    each("bench", "prompts", lambda v: file_path(v, folder) if v.endswith(PROMPT_FILE_SUFFIXES) else v)
    return tree
