"""Stage reports and the run index, rendered through the real pipeline on small real notebooks."""

import json
import re

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from eagle3lib.workbook import pipeline, report

WIDGET_STAGE = """
from tqdm.auto import tqdm
from eagle3lib.workbook import open_stage, widgets
from eagle3lib.train.metrics import acceptance_summary
stage = open_stage("00_look", params_file, run_dir, overrides)
out = stage.out
for _ in tqdm(range(7), desc="counting"):
    pass
evals = [{"step": 5, "eval": acceptance_summary([0.5, 0.25], [0.5, 0.5], 4)}]
widgets.show(widgets.accuracy_explorer(evals), widgets.evals_table_html(evals))
(out / "made.txt").write_text("made")
(out / "sub").mkdir(exist_ok=True)
(out / "sub" / "a.bin").write_bytes(b"x" * 2000)
result = stage.save({"n": 7}, headline={"items counted": 7, "share": 0.123456}, artifacts=["made.txt"])
"""


def make_workbook(tmp_path):
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = new_code_cell("params_file = None\nrun_dir = None\noverrides = {}")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [
        new_markdown_cell("# 00 · Look: a widget stage\n\nWhat this stage does, after the summary."),
        params,
        new_code_cell(WIDGET_STAGE),
    ]
    nbformat.write(nb, nbs / "00_look.ipynb")
    second = new_notebook(metadata=nb.metadata)
    second.cells = [
        params.copy(),
        new_code_cell(
            'from eagle3lib import run_folder\nrun_folder.save_result(run_dir, "01_next", {}, headline={"fine": True})'
        ),
    ]
    nbformat.write(second, nbs / "01_next.ipynb")
    params_file = tmp_path / "params" / "t.yaml"
    params_file.parent.mkdir()
    params_file.write_text("run: {output_root: ../outputs}\n")
    return nbs, params_file


def test_stage_report_opens_with_its_summary_and_has_static_widgets(tmp_path, capsys):
    nbs, params_file = make_workbook(tmp_path)
    run_dir = pipeline.run_pipeline(params_file, notebooks_dir=nbs, log_output=False)
    page = (run_dir / "00_look" / "00_look.html").read_text().replace('"', "'")
    # the summary sits under the title and before the introduction
    title, summary, intro = (
        page.index("00 · Look: a widget stage"),
        page.index("class='e3-summary'"),
        page.index("What this stage does"),
    )
    assert title < summary < intro
    for text in (
        "items counted",
        "0.1235",
        "finished in",
        "href='made.txt'",
        "href='sub/'",
        "2.0 kB",
        "href='../index.html'",
        "href='../01_next/01_next.html'",
    ):
        assert text in page, text
    # widgets: the static table and the tqdm bar's final state; no widget JavaScript, nothing from a CDN
    assert "est. len @3" in page and "counting:\u2007100%" in page and "<progress max='7.0' value='7.0'>" in page
    assert "widget-view+json" not in page and "widget-state+json" not in page
    assert "cdnjs" not in page and "unpkg" not in page and not re.search(r"<script[^>]* src=", page)
    assert "<div class='jp-CodeMirrorEditor" in page  # code shown by default
    # the executed notebook keeps its widgets; only the report is static
    executed = nbformat.read(run_dir / "00_look" / "00_look.ipynb", as_version=4)
    assert "widgets" in executed.metadata

    # run.hide_code is not part of any stage's hash: the stages are skipped, their reports re-rendered
    capsys.readouterr()
    pipeline.run_pipeline(params_file, {"run.hide_code": True}, notebooks_dir=nbs, log_output=False)
    assert capsys.readouterr().err.count("unchanged, skipped") == 2
    hidden = (run_dir / "00_look" / "00_look.html").read_text().replace('"', "'")
    assert "<div class='jp-CodeMirrorEditor" not in hidden and "items counted" in hidden and "est. len @3" in hidden
    assert json.loads((run_dir / "00_look" / "result.json").read_text())["hide_code"] is True


def test_index_shows_stages_params_versions_and_time(tmp_path):
    nbs, params_file = make_workbook(tmp_path)
    run_dir = pipeline.run_pipeline(params_file, notebooks_dir=nbs, log_output=False)
    page = (run_dir / "index.html").read_text().replace('"', "'")
    for text in (
        "href='00_look/00_look.html'",
        "href='01_next/01_next.html'",
        "items counted",
        "0.1235",
        "all 2 stages finished",
        "total stage time",
        "<h2>Versions</h2>",
        "torch",
        "<h2>Params</h2>",
        "hide_code: false",
        "href='run.json'",
    ):
        assert text in page, text


def test_recommendation_reads_either_way(tmp_path):
    rows = [
        {"concurrency": 1, "depth": 0, "config": "baseline", "tokens_per_s": 20.0, "speedup": 1.0},
        {"concurrency": 1, "depth": 5, "config": "depth5", "tokens_per_s": 30.0, "speedup": 1.5, "accept_len": 2.1},
        {"concurrency": 8, "depth": 0, "config": "baseline", "tokens_per_s": 90.0, "speedup": 1.0},
        {"concurrency": 8, "depth": 5, "config": "depth5", "tokens_per_s": 80.0, "speedup": 0.89, "accept_len": 2.0},
    ]
    rec = {
        "1": {
            "config": "depth5",
            "depth": 5,
            "tokens_per_s": 30.0,
            "speedup": 1.5,
            "accept_len": 2.1,
            "vllm": "python -m vllm ... 5",
            "sglang": "python -m sglang ... 5",
        },
        "8": {
            "config": "baseline",
            "depth": 0,
            "tokens_per_s": 90.0,
            "speedup": 1.0,
            "accept_len": None,
            "vllm": "python -m vllm",
            "sglang": "python -m sglang",
        },
    }
    page = report._recommendation_html({"figures": {"rows": rows, "recommendation": rec}})
    assert "<b>depth5</b>: 30 tokens/s, <b>1.50x</b> the no-speculation baseline, acceptance length 2.1" in page
    assert "<b>no speculation</b> (90 tokens/s): no depth beat the baseline; the best, depth5, ran at 0.89x" in page
    assert "python -m vllm ... 5" in page


def test_index_prints_the_per_set_table_as_the_papers_do():
    """A result.json's per set table (its depths as JSON keys, strings) on the run's page."""
    cell = {"accept_len": 1.7, "speedup": 1.3, "requests": 2, "predicted_accept_len": 1.8}
    table = {"concurrency": 1, "depths": [2], "sets": [
        {"set": "mt_bench", "prompts": 4, "baseline_tokens_per_s": 10.0, "cells": {"2": cell}}]}  # fmt: skip
    page = report._sets_html({"figures": {"sets": {"tables": [table]}}})
    assert "<h2>Per prompt set</h2>" in page and "<th colspan=3>depth 2</th>" in page
    assert "<td>mt_bench</td><td>4</td><td>10.0</td><td>1.70</td><td>1.80</td><td>1.30x</td>" in page
    assert report._sets_html({"figures": {}}) == ""


def run_with_failing_cell(nbs, params_file, notebook: str, cell: int, source: str) -> None:
    """Make one cell of a workbook notebook raise, then run the pipeline through the failure."""
    nb = nbformat.read(nbs / notebook, as_version=4)
    nb.cells[cell].source = source
    nbformat.write(nb, nbs / notebook)
    with pytest.raises(pipeline.StageError):
        pipeline.run_pipeline(params_file, notebooks_dir=nbs, log_output=False)


def test_failed_stage_report_says_so_first(tmp_path):
    nbs, params_file = make_workbook(tmp_path)
    run_with_failing_cell(nbs, params_file, "01_next.ipynb", 1, "raise ValueError('no luck today')")
    run_dir = tmp_path / "outputs" / "t"
    page = (run_dir / "01_next" / "01_next.html").read_text().replace('"', "'")
    assert page.index("stage failed after") < page.index("Traceback")
    # papermill's own red banner is gone; the summary links to its marker above the failed cell
    assert "An Exception was encountered" not in page
    assert "href='#papermill-error-cell'" in page and "id='papermill-error-cell'" in page
    assert "ValueError: no luck today" in (run_dir / "index.html").read_text()


def test_index_marks_results_a_failure_left_from_an_earlier_run(tmp_path):
    nbs, params_file = make_workbook(tmp_path)
    run_dir = pipeline.run_pipeline(params_file, notebooks_dir=nbs, log_output=False)
    run_with_failing_cell(nbs, params_file, "00_look.ipynb", 2, "raise KeyError('gone')")
    page = (run_dir / "index.html").read_text()
    assert "0 of 2 stages finished" in page and "the run stopped when 00_look failed'>ok, earlier run<" in page


def test_fmt_and_duration():
    assert [report.fmt(x) for x in (None, True, 12345, 0.123456, 2.0, "x")] == [
        "–",
        "yes",
        "12,345",
        "0.1235",
        "2",
        "x",
    ]
    assert [report.duration(x) for x in (None, 3.21, 125, 7300)] == ["–", "3.2 s", "2 min 05 s", "2 h 01 min"]


def test_log_excerpt_keeps_what_a_reader_wants(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text(
        "\x1b[32mINFO\x1b[0m Route: /health\nINFO Resolved architecture: LlamaForCausalLMEagle3\n"
        "WARNING fd limits can cause `OSError`\nINFO Using auxiliary layers from speculative config: (2, 15, 27)\n"
        "\x1b[31mERROR\x1b[0m the drafter failed " + "x" * 400 + "\nINFO Shutting down\n"
    )
    with open(log, "a") as f:
        f.write(
            "Exception ignored in: <function __del__>\nTraceback (most recent call last):\n  File x\n"
            "RecursionError: maximum recursion depth exceeded\nINFO Loading drafter model... " + "x" * 400 + "\n"
        )
    text = report.log_excerpt(log)
    assert text.splitlines()[0] == (
        "engine.log: 11 lines, 3 worth reading; it also holds 1 error-level line(s) "
        "and 1 traceback(s), read them there:"
    )
    assert "LlamaForCausalLMEagle3" in text and "(2, 15, 27)" in text and "Loading drafter model" in text
    for hidden in ("Route", "OSError", "Shutting", "\x1b", "Traceback", "RecursionError", "the drafter failed"):
        assert hidden not in text, hidden
    assert max(len(line) for line in text.splitlines()) < 230
    assert report.log_excerpt(log, max_lines=1).count("\n") == 1 and "the first 1 shown" in report.log_excerpt(
        log, max_lines=1
    )
    assert "no log at" in report.log_excerpt(tmp_path / "none.log")
