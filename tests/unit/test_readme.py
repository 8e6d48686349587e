"""The README gets a newcomer to a first success on one screen, and every figure it states is its result file's: each
row of its Results table links a result folder, and each figure in the row equals a headline value of that folder's
result.json at the precision the README prints."""

import json
import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 120
# a figure: a decimal (1.069) or a count with thousands separators (53,347); not a version (0.9.0) or a name (3.1-8B)
FIGURE = re.compile(r"(?<![\w.\-])(\d{1,3}(?:,\d{3})+|\d+\.\d+)(?![\d.\-])(?!(?!x)\w)")  # 1.069x is a figure
LINK = re.compile(r"\]\((benchmarks/results/[^)]+?)/?\)")


def results_rows(text: str) -> list[str]:
    section = text.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("|") and LINK.search(line)]


def as_printed(value: float, printed: str) -> str:
    """value rounded as `printed` is: the same decimals, or a whole number with thousands separators."""
    if "." in printed:
        places = Decimal(1).scaleb(-len(printed.split(".")[1]))
        return str(Decimal(repr(value)).quantize(places, rounding=ROUND_HALF_UP))
    return f"{int(Decimal(repr(value)).quantize(Decimal(1), rounding=ROUND_HALF_UP)):,}"


def unmatched_figures(row: str, headline: dict) -> list[str]:
    figures = FIGURE.findall(LINK.sub("", row))
    values = [v for v in headline.values() if isinstance(v, int | float)]
    return [f for f in figures if not any(as_printed(v, f) == f for v in values)]


def test_the_readme_fits_a_screen_or_two_and_starts_with_the_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines: move detail to docs/"
    first_screen = "\n".join(lines[:30])
    assert "make run" in first_screen and "make test" in first_screen


def test_every_readme_figure_is_its_result_files():
    rows = results_rows(README.read_text())
    assert rows, "README.md's Results table links no result folder"
    for row in rows:
        folder = ROOT / LINK.search(row).group(1)
        result = folder / "result.json"
        assert result.is_file(), f"README.md links {folder.relative_to(ROOT)}, which has no result.json"
        headline = json.loads(result.read_text())["headline"]
        missing = unmatched_figures(row, headline)
        assert not missing, f"README.md states {missing} for {folder.relative_to(ROOT)}: not in its headline {headline}"


def test_a_retyped_figure_is_caught():
    headline = {"ratio": 1.0692, "low": 1.0578, "tokens_per_s": 53347.0}
    assert (
        unmatched_figures("| x | 1.069x [1.058] and 53,347 tokens/s, Llama-3.1-8B, speculators 0.9.0 |", headline) == []
    )
    assert unmatched_figures("| x | 1.08x [1.058] and 53,348 tokens/s |", headline) == ["1.08", "53,348"]
