"""What the repository says speaks to a person using or maintaining the tool, not to the way it was built: no issue
numbers, no numbered or dated work sessions, no word about which machines were available, no dates of the work.
A figure is cited by its result folder (benchmarks/results/<question>/<hardware>-<date>/), which carries its date, so
a date inside such a path is the one date allowed. "session" in its technical senses (a pytest fixture's scope, a
process session, a capture session) is not matched."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLACES = ("README.md", "docs", "params", "notebooks", "eagle3lib", "tests", "benchmarks")
SUFFIXES = {".md", ".py", ".yaml", ".yml", ".ipynb", ".sh", ".toml", ".txt", ".json", ""}
ORDINAL = r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\w+teenth|\w+tieth|\d+(?:st|nd|rd|th))"
PATTERNS = {
    "an issue number": re.compile(r"\bissues? \d+", re.IGNORECASE),
    "a numbered session": re.compile(r"\bsessions? \d+", re.IGNORECASE),
    "an ordinal session": re.compile(rf"\b{ORDINAL} session\b", re.IGNORECASE),
    "a dated session": re.compile(r"\bsession of 20\d\d", re.IGNORECASE),
    "'lent'": re.compile(r"\blent\b", re.IGNORECASE),
    "a date of the work": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
}
RESULT_PATH = re.compile(r"(?:benchmarks/)?results/[\w./-]+")
# result files keep their dates (a result has one), and what a run writes into them verbatim is data
DATED_HERE = ("benchmarks/results/",)
THIS_FILE = Path(__file__).resolve()


def files() -> list[Path]:
    found = []
    for place in PLACES:
        path = ROOT / place
        candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        found += [p for p in candidates if p.suffix in SUFFIXES and p.resolve() != THIS_FILE]
    return found


def findings(path: Path, relative: str) -> list[str]:
    """'line N: <what> in "<text>"' for each forbidden pattern in the file."""
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        return []
    if relative.startswith("benchmarks/results/") and path.suffix not in {".md", ".py", ".sh"}:
        return []  # raw rows, logs and summaries a run wrote: data, not prose
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        prose = RESULT_PATH.sub("", line)
        for what, pattern in PATTERNS.items():
            if what == "a date of the work" and relative.startswith(DATED_HERE):
                continue
            m = pattern.search(prose)
            if m:
                out.append(f"line {n}: {what} in {m.group(0)!r}")
    return out


@pytest.mark.parametrize("path", files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_words_are_for_users(path):
    relative = str(path.relative_to(ROOT))
    found = findings(path, relative)
    assert not found, f"{relative}: say it for a user (cite a result folder for a figure):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "the run of issue 43 measured it",
        "as session 9 found",
        "the fifteenth session's call",
        "see the session of 2026-12-06",
        "no host of several GPUs was lent",
        "measured on 2026-12-03",
    ],
)
def test_a_planted_line_is_found(tmp_path, line):
    planted = tmp_path / "planted.md"
    planted.write_text(f"A fine line.\n{line}\n")
    assert findings(planted, "docs/planted.md")[0].startswith("line 2: ")


@pytest.mark.parametrize(
    "line",
    [
        "a pytest fixture with scope='session'",
        "start_new_session=True puts the server in a process session of its own",
        "the capture session with the target",
        "cited by benchmarks/results/peers/h100-2026-12-05/README.md",
        "talent and silent words",
    ],
)
def test_technical_senses_and_result_paths_pass(tmp_path, line):
    planted = tmp_path / "ok.md"
    planted.write_text(line + "\n")
    assert findings(planted, "docs/ok.md") == []
