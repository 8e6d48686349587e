"""benchmarks/results/ holds one folder per standing result, benchmarks/results/<question>/<hardware>-<date>/, each
with a result.json a reader (and the runner's index) can rely on and a README.md that says how it was made.

A result's `command` is what reproduces it, one command a line, in order: the runner's (`python -m benchmarks
QUESTION ...`, after any VAR=value its GPU plan reads, or under torchrun), a helper module of benchmarks/
(`python -m benchmarks.al_interval ...`), eagle3lib's CLI, or a `#` line saying what no runner option reproduces.
Every runner line is read by the runner's and the question's own parsers (runner.parse), nothing run."""

import json
import re
import shlex
from pathlib import Path

import pytest

from benchmarks import record, runner

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
FIELDS = ("question", "hardware", "date", "command", "machine", "versions", "headline")
FOLDER = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*-(\d{4}-\d{2}-\d{2})(?:-[a-z0-9-]+)?$")
MAX_BYTES = 1_000_000
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def folders() -> list[Path]:
    return sorted(p for p in RESULTS.glob("*/*") if p.is_dir())


def test_results_are_filed_by_question():
    assert folders(), "no result folders"
    stray = [p.name for p in RESULTS.iterdir() if p.is_file() or not any(c.is_dir() for c in p.iterdir())]
    assert not stray, f"benchmarks/results/ holds only <question>/ folders: {stray}"


@pytest.mark.parametrize("folder", folders(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_a_result_folder_says_what_it_holds(folder):
    match = FOLDER.match(folder.name)
    assert match, f"{folder.name}: name it <hardware>-<YYYY-MM-DD>[-<variant>]"
    result = json.loads((folder / "result.json").read_text())
    missing = [f for f in FIELDS if f not in result]
    assert not missing, f"result.json lacks {missing}"
    assert result["question"] == folder.parent.name
    assert result["date"] == match.group(1)
    assert folder.name.startswith(f"{result['hardware']}-{result['date']}")
    assert runner_lines(result["command"]), "the command holds a `python -m benchmarks QUESTION` line"
    assert result["headline"] and all(isinstance(v, (int, float)) for v in result["headline"].values())
    readme = (folder / "README.md").read_text()
    assert result["command"] in readme, "README.md shows the command of result.json"


@pytest.mark.parametrize("folder", folders(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_no_job_markers_or_large_files(folder):
    for path in folder.rglob("*"):
        if not path.is_file():
            continue
        assert path.suffix not in (".job", ".done"), f"{path.relative_to(RESULTS)}: a job marker"
        assert path.stat().st_size <= MAX_BYTES or path.suffix == ".gz", f"{path.relative_to(RESULTS)}: over 1 MB"


def test_the_index_links_exist():
    text = (ROOT / "benchmarks" / "README.md").read_text()
    links = re.findall(r"\]\((results/[^)]+)\)", text)
    assert links, "benchmarks/README.md has an index of result folders"
    missing = [link for link in links if not (ROOT / "benchmarks" / link).is_dir()]
    assert not missing, f"benchmarks/README.md links to missing folders: {missing}"


def runner_lines(command: str) -> list[str]:
    return [line for line in command.splitlines() if " -m benchmarks " in f"{line} "]


def problems(command: str) -> list[str]:
    """What is wrong with a result's command, line by line: a runner line its parsers refuse (or whose VAR=value its
    GPU plan's script never reads), a helper module that is not there, a line that is none of the kinds."""
    found = []
    for line in command.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        words = shlex.split(line)
        variables = []
        while words and ASSIGNMENT.match(words[0]):  # the environment the command runs in
            variables.append(words.pop(0).split("=", 1)[0])
        module = words[words.index("-m") + 1] if "-m" in words[:-1] else None
        if module == "benchmarks":
            argv = words[words.index("-m") + 2 :]
            try:
                question, _ = runner.parse(argv)
            except SystemExit as e:
                found.append(f"{line!r}: refused ({e.code})")
                continue
            if "gpu-plan" in argv:
                script = (ROOT / "benchmarks" / "questions" / f"{question}.sh").read_text()
                unread = [v for v in variables if f"${v}" not in script and f"${{{v}" not in script]
                if unread:
                    found.append(f"{line!r}: {question}.sh reads no {unread}")
        elif module and module.startswith("benchmarks."):
            if not (ROOT / (module.replace(".", "/") + ".py")).is_file():
                found.append(f"{line!r}: no module {module}")
        elif module != "eagle3lib":
            found.append(f"{line!r}: neither a runner command, a benchmarks helper, eagle3lib's CLI nor a # comment")
    return found


@pytest.mark.parametrize("folder", folders(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_the_command_is_one_the_runner_accepts(folder):
    command = json.loads((folder / "result.json").read_text())["command"]
    assert not problems(command)


def test_a_command_the_runner_refuses_is_caught():
    good = "python -m benchmarks batches --tokens 300000\nTAG=-d3 python -m benchmarks peers gpu-plan serve"
    assert not problems(good)
    planted = {
        "python -m benchmarks no_such_question": "refused",
        'python -m benchmarks peers --jobs "ours:allpos:0" --depths 3,5': "refused",
        "python -m benchmarks served_al --drafter a=DIR": "refused",  # its run_dir and --params are required
        "python -m benchmarks first_run --set bench.dtype=float32": "refused",
        "python -m benchmarks release gpu-plan no_such_step": "refused",
        "NO_SUCH_VARIABLE=1 python -m benchmarks online gpu-plan 8b": "reads no",
        "python -m benchmarks.no_such_helper summary.json": "no module",
        "bash benchmarks/h200/peers.sh serve": "neither",
    }
    for line, why in planted.items():
        found = problems(f"python -m benchmarks batches\n{line}")
        assert len(found) == 1 and why in found[0], (line, found)


CITED_IN = ("README.md", "docs", "params", "eagle3lib", "notebooks")
CITATION = re.compile(r"benchmarks/results/([a-z0-9_]+)/([A-Za-z0-9_.-]+)")


def test_every_cited_result_folder_exists():
    """A figure is cited by its result folder: the folder a README, doc, recipe or docstring names must be there."""
    missing = []
    for place in CITED_IN:
        path = ROOT / place
        for f in (
            [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in {".md", ".py", ".yaml"})
        ):
            for question, folder in CITATION.findall(f.read_text()):
                if not (ROOT / "benchmarks" / "results" / question / folder.rstrip(".")).is_dir():
                    missing.append(f"{f.relative_to(ROOT)}: benchmarks/results/{question}/{folder}")
    assert not missing, "cited result folders that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    "flags, name",
    [({"avx2", "avx512f"}, "cpu-epyc-avx2-2c"), ({"avx2", "avx512_bf16"}, "cpu-epyc-2c"), (None, "cpu-epyc-2c")],
)
def test_a_cpus_hardware_name_says_where_its_bf16_is_emulated(monkeypatch, flags, name):
    monkeypatch.setattr(record, "gpus", lambda: [])
    monkeypatch.setattr(record, "cpu_model", lambda: "AMD EPYC 9B14")
    monkeypatch.setattr(record, "cpu_flags", lambda: flags)
    monkeypatch.setattr(record.os, "cpu_count", lambda: 2)
    assert record.hardware() == name
