"""The workbook around the stages: the papermill pipeline, the stage notebooks' preamble (open_stage), reports,
widgets and plots."""

from eagle3lib.workbook.stage import Stage, open_stage  # noqa: F401  (the notebooks' preamble)
