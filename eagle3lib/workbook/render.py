"""A stage's HTML report, rendered by nbconvert from its executed notebook: the result's summary under the title,
widgets as their static renderings, code cells shown or hidden, and nothing loaded from a network."""

from __future__ import annotations

import logging
from pathlib import Path

from eagle3lib import run_folder


def render_html(notebook: Path, hide_code: bool, result: dict | None = None, neighbours: tuple = (None, None)) -> Path:
    """The stage report beside the executed notebook: a summary of `result` (status, time, headline figures,
    what the stage made) under the title, widgets as their static renderings, code cells shown or hidden."""
    import nbformat
    from nbconvert import HTMLExporter

    from eagle3lib.workbook import report

    nb = nbformat.read(notebook, as_version=4)
    report.static_widgets(nb)
    if result is not None:
        error_anchor = report.drop_papermill_banner(nb)
        report.insert_summary(
            nb, report.stage_summary_html(result, notebook.parent, notebook.stem, neighbours, error_anchor)
        )
    # The notebook's default parameters cell is followed by papermill's injected one, which tells the truth.
    nb.cells = [c for c in nb.cells if "parameters" not in c.metadata.get("tags", [])]
    # nbconvert's own warnings ("Alternative text is missing on N image(s).") go to the stage's log, not the console
    log = logging.getLogger("eagle3lib.nbconvert")
    log.propagate = False
    to_stage_log = logging.FileHandler(notebook.with_suffix(".log"), mode="a")
    to_stage_log.setFormatter(logging.Formatter("%(asctime)s nbconvert %(levelname)s %(message)s"))
    log.addHandler(to_stage_log)
    try:
        exporter = HTMLExporter(
            template_name="lab", exclude_input=hide_code, exclude_input_prompt=hide_code,
            exclude_output_prompt=hide_code, log=log,
        )  # fmt: skip
        body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": notebook.stem}})
    finally:
        log.removeHandler(to_stage_log)
        to_stage_log.close()
    out = notebook.with_suffix(".html")
    run_folder.write_text(out, _offline(body))  # whole or not at all; a full disk's error names it
    return out


def _offline(page: str) -> str:
    """Drop the lab template's require.js, MathJax and mermaid scripts: they come from a CDN, the stage
    notebooks use none of them (no LaTeX or diagrams, widgets are static in reports), and a report must open
    without a network."""
    import re

    page = re.sub(r'<script src="https://cdnjs\.cloudflare\.com/ajax/libs/require\.js/[^"]*"></script>\s*', "", page)
    page = re.sub(r"<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->", "", page, flags=re.S)
    page = re.sub(
        r'<script type="module">(?:(?!</script>).)*?cdnjs\.cloudflare\.com/ajax/libs/mermaid.*?</script>\s*',
        "",
        page,
        flags=re.S,
    )
    return page
