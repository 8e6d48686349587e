"""Typed run parameters: one YAML file per run (a recipe), a section per stage.

A recipe may stand on a base recipe (`base:`) and states only what differs from it; what no file states is the
code's default (the section models' Field defaults). Unknown keys are errors that list the valid ones, so a typo
never silently falls back to a default. Relative paths resolve against the folder of the file that states them, so
a run means the same thing from the CLI, papermill and JupyterLab whatever the working directory.

  schema.py    the sections up to training (run, target, data, extract, train)
  serving.py   the engine and benchmark sections
  model.py     Params, the whole file, and the checks across sections
  files.py     reading a file: UTF-8 YAML, its base: chain
  loading.py   load_params: overrides, validation, absolute paths, auto dtypes
  stages.py    what each stage reads (STAGE_SECTIONS) and the view that holds it to that (stage_view)
"""

from eagle3lib.params.files import ParamsError
from eagle3lib.params.loading import cache_dir, dumps, load_params, params_from_tree, parse_override, run_dir
from eagle3lib.params.model import Params
from eagle3lib.params.schema import (
    EMBEDDED_DATA,
    EMBEDDED_TARGET,
    EMBEDDED_TARGET_LAYERS,
    EXTRACT_BACKENDS,
    ComputeDtype,
    DataParams,
    Dtype,
    ExtractParams,
    MLAParams,
    RegenerateParams,
    RunParams,
    Section,
    StoreDtype,
    TargetParams,
    TrainParams,
)
from eagle3lib.params.serving import PROMPT_SET_NAMES, BenchParams, EngineParams
from eagle3lib.params.stages import (
    BOOKKEEPING,
    STAGE_SECTIONS,
    Read,
    UnreadSection,
    UnreadSectionError,
    stage_sections,
    stage_view,
)

__all__ = [
    "BOOKKEEPING",
    "EMBEDDED_DATA",
    "EMBEDDED_TARGET",
    "EMBEDDED_TARGET_LAYERS",
    "EXTRACT_BACKENDS",
    "PROMPT_SET_NAMES",
    "STAGE_SECTIONS",
    "BenchParams",
    "ComputeDtype",
    "DataParams",
    "Dtype",
    "EngineParams",
    "ExtractParams",
    "MLAParams",
    "Params",
    "ParamsError",
    "Read",
    "RegenerateParams",
    "RunParams",
    "Section",
    "StoreDtype",
    "TargetParams",
    "TrainParams",
    "UnreadSection",
    "UnreadSectionError",
    "cache_dir",
    "dumps",
    "load_params",
    "params_from_tree",
    "parse_override",
    "run_dir",
    "stage_sections",
    "stage_view",
]
