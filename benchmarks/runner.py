"""The runner behind `python -m benchmarks`: `list` prints each question with its docstring's first line; QUESTION
runs that question's main with the options given (a CPU-sized version with --dry-run), keeps the JSON lines it
prints as its rows and writes the result folder (record.py).

    python -m benchmarks QUESTION [--dry-run] [--out DIR] [--hardware NAME] [--] [the question's options]

--out DIR: where <question>/<hardware>-<date>/ goes (default benchmarks/results/ for a run, a new temp folder for a
dry run: a dry run never writes into benchmarks/results/). Under torchrun only rank 0 writes it.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import io
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

from benchmarks import record

QUESTIONS = Path(__file__).resolve().parent / "questions"


def names() -> list[str]:
    return sorted(p.stem for p in QUESTIONS.glob("*.py") if not p.stem.startswith("_"))


def docstring(name: str) -> str:
    """A question's docstring, read without importing it (list stays quick)."""
    path = QUESTIONS / f"{name}.py"
    return ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""


def about(name: str) -> str:
    return docstring(name).split("\n\n")[0]


class Tee(io.TextIOBase):
    """stdout as it was, with every line kept (the JSON ones become the result's rows)."""

    def __init__(self, stream):
        self.stream, self.lines, self.part = stream, [], ""

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.part += text
        *done, self.part = self.part.split("\n")
        self.lines += done
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def rows(self) -> list[dict]:
        found = []
        for line in self.lines + [self.part]:
            if line.startswith("{"):
                try:
                    found.append(json.loads(line))
                except ValueError:
                    pass
        return found


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", add_help=False)
    ap.add_argument("question")
    ap.add_argument("--dry-run", action="store_true", help="a CPU-sized version, for real, in seconds to minutes")
    ap.add_argument("--out", type=Path, default=None, help="the results' root (default benchmarks/results/)")
    ap.add_argument("--hardware", default=None, help="the result folder's hardware name (default: this machine's)")
    return ap


def print_list() -> int:
    for name in names():
        print(f"{name:<18} {about(name).splitlines()[0] if about(name) else ''}")
    return 0


def run(argv: list[str]) -> int:
    known, rest = parser().parse_known_args(argv)
    if known.question not in names():
        print(f"no question {known.question!r}; `python -m benchmarks list` names them", file=sys.stderr)
        return 2
    rest = rest[1:] if rest[:1] == ["--"] else rest
    module = importlib.import_module(f"benchmarks.questions.{known.question}")
    if "-h" in rest or "--help" in rest:  # the question's own options: nothing is run, so nothing is recorded
        return module.main(rest) or 0
    root = known.out or (Path(tempfile.mkdtemp(prefix="benchmarks-dry-")) if known.dry_run else record.RESULTS)
    hardware_name, date = known.hardware or record.hardware(), record.today()
    where = record.folder(root, known.question, hardware_name, date)
    where.mkdir(parents=True, exist_ok=True)
    args = module.dry_run(where / "work") + rest if known.dry_run else rest
    if getattr(module, "OUT_FILE", None) and "--out" not in args:
        args += ["--out", str(where / module.OUT_FILE)]
    tee, stdout = Tee(sys.stdout), sys.stdout
    sys.stdout = tee
    try:
        code = module.main(args) or 0
    except SystemExit as e:  # argparse's refusals and a question's own exit status
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.stdout = stdout
    if os.environ.get("RANK", "0") != "0":
        return code
    if code != 0:  # a failed run is no result: what it wrote stays in its folder, without a result.json
        print(f"exit status {code}: no result written (its files, if any: {where})", file=sys.stderr)
        if not any(where.rglob("*")):
            where.rmdir()
        return code
    rows = tee.rows()
    headline = module.headline(rows) if hasattr(module, "headline") and rows else {}
    skipped = [r["skipped"] for r in rows if "skipped" in r]
    data = {"headline": headline, "dry_run": known.dry_run, "exit_status": code, "skipped": skipped, "rows": rows}
    command = "python -m benchmarks " + shlex.join(argv)
    path = record.write(
        where, question=known.question, hardware_name=hardware_name, date=date, command=command,
        about=about(known.question), data=data,
    )  # fmt: skip
    print(f"result: {path}", file=sys.stderr)
    return code


class Parsed(Exception):
    """Raised by a question's parser in place of running it (parse): the options it read."""

    def __init__(self, options: argparse.Namespace):
        super().__init__(options)
        self.options = options


def parse(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """The question and its options as `run` hands them to it, read by the question's own parser and nothing run
    (a check of a command). A refused option raises SystemExit, as argparse does. --dry-run's own options are not
    added."""
    known, rest = parser().parse_known_args(argv)
    if known.question not in names():
        raise SystemExit(f"no question {known.question!r}; `python -m benchmarks list` names them")
    rest = rest[1:] if rest[:1] == ["--"] else rest
    module = importlib.import_module(f"benchmarks.questions.{known.question}")
    if getattr(module, "OUT_FILE", None) and "--out" not in rest:
        rest = rest + ["--out", module.OUT_FILE]
    parse_args = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise Parsed(parse_args(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse_and_stop
    try:
        module.main(rest)
    except Parsed as parsed:
        return known.question, parsed.options
    finally:
        argparse.ArgumentParser.parse_args = parse_args
    raise SystemExit(f"{known.question}: its main returned without reading its options")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] == "list":
        return print_list()
    return run(argv)
