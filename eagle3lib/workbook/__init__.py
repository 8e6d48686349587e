"""The workbook around the stages: the papermill pipeline, reports, widgets and plots."""
