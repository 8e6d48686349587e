"""load_params: a params file read with its bases (files.py), overridden, validated into Params, its paths made
absolute and its auto dtypes picked; and the small readers of a loaded run (cache_dir, run_dir, dumps)."""

from __future__ import annotations

import copy
import difflib
import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from eagle3lib.params.files import BASE_KEY, ParamsError, file_path, read_recipe, where
from eagle3lib.params.model import Params


def load_params(path: str | Path, overrides: dict | None = None) -> Params:
    """Read (with its base: chain), override (dotted keys: {"extract.batch_tokens": 2048}) and validate a params
    file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ParamsError(
            f"params file not found: {path} (the shipped recipes are in the repository's params/ folder, "
            "e.g. params/smollm2-135m-cpu.yaml)"
        )
    tree, files = read_recipe(path)
    return params_from_tree(tree, path, overrides, bases=files[1:])


def params_from_tree(tree: dict, path: Path, overrides: dict | None = None, bases: list[Path] = ()) -> Params:
    """Params from a recipe's merged tree (its bases already under it) as load_params makes them: overrides, the
    default run.name (path's stem), validation, absolute paths (against path's folder) and auto dtypes."""
    tree = copy.deepcopy(tree)
    for key, value in (overrides or {}).items():
        _set_dotted(tree, key, value)
    if not isinstance(tree.setdefault("run", {}), dict):
        raise ParamsError(f"{path}: run: expected a section (a mapping of keys), got {tree['run']!r}")
    if not tree["run"].get("name"):
        tree["run"]["name"] = path.stem
    try:
        p = Params.model_validate(tree)
    except ValidationError as e:
        on = f" (on its base {', '.join(str(b) for b in bases)})" if bases else ""
        raise ParamsError(_format_errors(e, f"{path}{on}")) from None
    p.file = str(path.resolve())
    p.overrides = dict(overrides or {})
    resolve_paths(p, path.resolve().parent)
    _resolve_auto_dtypes(p)
    return p


def _valid_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return [*Params.section_names(), BASE_KEY] if model is Params else list(model.model_fields)


def _format_errors(err: ValidationError, where: str) -> str:
    lines = [f"{where}: {err.error_count()} problem(s)"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            valid = _valid_keys(Params, e["loc"])
            close = difflib.get_close_matches(str(e["loc"][-1]), valid, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            lines.append(f"  - unknown key '{key}'{hint}; valid keys here: {', '.join(valid)}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = e.get("input")
            lines.append(f"  - {key}: {msg}" + ("" if isinstance(got, dict) else f" (got {got!r})"))
    return "\n".join(lines)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ParamsError(f"override '{dotted}': '{p}' is not a section")
    node[leaf] = value


def resolve_paths(p: Params, folder: Path) -> None:
    """The params' relative paths (and the code's default output_root) made absolute against the params file's
    folder; the drafter of train.init_from and the files of data.keep_unseen must exist."""
    p.run.output_root = file_path(p.run.output_root, folder, expand_user=False)
    if p.run.cache_dir:
        p.run.cache_dir = file_path(p.run.cache_dir, folder)
    p.data.sources = [where(s, folder) for s in p.data.sources]
    p.data.keep_unseen = [file_path(f, folder, expand_user=False) for f in p.data.keep_unseen]
    for f in p.data.keep_unseen:
        if not Path(f).is_file():
            raise ParamsError(f"data.keep_unseen: no params file at {f} (paths are relative to this params file)")
    p.target.name = where(p.target.name, folder)
    if p.train.init_from:
        p.train.init_from = file_path(p.train.init_from, folder)
        if not Path(p.train.init_from).is_dir():
            raise ParamsError(
                f"train.init_from: no drafter folder at {p.train.init_from} (paths are relative to this params file)"
            )
    if p.engine.python:
        p.engine.python = where(p.engine.python, folder)


def _resolve_auto_dtypes(p: Params) -> None:
    """'auto' -> the dtype that is fast on this machine, before anything hashes or runs the params, so the
    stages, their hashes and the run folder's params all say what actually ran."""
    from eagle3lib import hardware

    device = "cuda" if p.target.device.startswith("cuda") else "cpu"
    for section in ("target", "train", "bench"):
        params = getattr(p, section)
        if params.dtype == "auto":
            picked, why = hardware.auto_dtype(device)
            params.dtype = picked
            p.dtype_choices[f"{section}.dtype"] = {"auto": True, "picked": picked, "why": why}


def parse_override(text: str) -> tuple[str, Any]:
    """`key.sub=value` from the command line; the value is read as YAML (numbers, lists, booleans), and 2e-3 is a
    number (YAML 1.1, which PyYAML reads, wants 2.0e-3)."""
    if "=" not in text:
        raise ParamsError(f"override '{text}': expected KEY=VALUE, e.g. extract.batch_tokens=2048")
    key, value = text.split("=", 1)
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError as e:
        problem = str(e).splitlines()[0]
        raise ParamsError(
            f"override '{text}': the value of {key.strip()} is not valid YAML ({problem}); quote it, e.g. "
            f"--set '{key.strip()}=[1, 2]' for a list or --set '{key.strip()}=\"text\"' for a string"
        ) from None
    if isinstance(parsed, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", parsed.strip()):
        parsed = float(parsed)
    return key.strip(), parsed


def cache_dir(p: Params) -> Path:
    if p.run.cache_dir:
        return Path(p.run.cache_dir)
    from eagle3lib.target import default_cache_dir

    return default_cache_dir()


def run_dir(p: Params) -> Path:
    return Path(p.run.output_root) / p.run.name


def dumps(p: Params) -> str:
    """The resolved params as YAML: every section, defaults and bases included (params check prints it)."""
    return yaml.safe_dump(json.loads(p.model_dump_json()), sort_keys=False)
