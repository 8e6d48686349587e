"""What the pipeline writes while a stage runs, beside what its cells write: the executed notebook, saved whole or not
at all, and the stage's log."""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

from eagle3lib import run_folder


@functools.cache
def atomic_notebook_writes() -> None:
    """papermill writes the executed notebook to an absolute path whole or not at all (run_folder.write_text): it
    saves it after cells as they run, and a save cut short by a full disk must not leave a torn notebook for the
    report, a rerun or JupyterLab to read; its error names the notebook."""
    from papermill.iorw import LocalHandler, papermill_io

    class AtomicLocalHandler(LocalHandler):
        def write(self, buf, path):
            run_folder.write_text(path, buf)

    papermill_io.register("/", AtomicLocalHandler())  # once (cached): absolute paths, ahead of its LocalHandler


class _QuietFileHandler(logging.FileHandler):
    """A stage's log file that drops the lines a full disk refuses instead of printing a traceback per line (the
    stage's error says the disk is full)."""

    def handleError(self, record):
        pass


@contextlib.contextmanager
def stage_log(path: Path, echo: bool):
    """Everything logged while a stage runs (papermill's cells and the notebook's output at INFO, warnings) into
    path; on the console too only when echo (a root handler then exists: __main__'s --verbose)."""
    handler = _QuietFileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root, papermill_log = logging.getLogger(), logging.getLogger("papermill")
    saved = root.level, papermill_log.level, list(root.handlers)
    # without echo the console keeps the progress bar and the stage lines only (other files keep logging)
    kept = saved[2] if echo else [h for h in saved[2] if isinstance(h, logging.FileHandler)]
    root.handlers[:] = [*kept, handler]
    root.setLevel(logging.INFO)
    papermill_log.setLevel(logging.INFO)
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(False)
        handler.close()
        root.handlers[:] = saved[2]
        root.setLevel(saved[0])
        papermill_log.setLevel(saved[1])
