"""What every stage notebook opens with: `stage = open_stage("05_benchmark", params_file, run_dir, overrides)`.

The arguments are the notebook's papermill parameters cell; the Stage it returns holds the run's params as this
stage sees them (params.stage_view: a section the stage's hash does not cover raises when read), the run folder and
this stage's folder, and reads earlier stages' results and saves this one's (eagle3lib.run_folder).
Importing this module imports eagle3lib first, which sets OMP_WAIT_POLICY before anything imports torch.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle3lib import params, run_folder


@dataclass
class Stage:
    name: str  # "05_benchmark"
    p: params.Params  # the stage's view of the run's params (params.stage_view)
    run_dir: Path
    out: Path  # this stage's folder in the run folder
    overrides: dict = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    # every section, for text about later stages only (00_prepare prints 01_extract's and online mode's plans): its
    # hash does not cover what this stage does not read, so nothing the stage makes may come from it
    all_params: params.Params | None = None

    @property
    def seconds(self) -> float:
        """Since the stage was opened, to 0.1 s."""
        return round(time.time() - self.started, 1)

    @property
    def deadline(self) -> float | None:
        """When this stage must end (time.time()) for the run to keep to run.minutes: the budget less the seconds
        its earlier stages took (their result.json, however many invocations made them), from when it opened;
        None without a budget."""
        if self.p.run.minutes is None:
            return None
        return self.started + self.p.run.minutes * 60 - run_folder.seconds_before(self.run_dir, self.name)

    @property
    def cache_dir(self) -> Path:
        return params.cache_dir(self.p)

    @property
    def target_dir(self) -> str:
        """The target's local folder (the embedded one's cache folder), or its hub id."""
        from eagle3lib import target

        return target.resolve_target(self.p.target.name, self.cache_dir)

    def folder(self, stage: str) -> Path:
        """An earlier stage's folder."""
        return run_folder.stage_dir(self.run_dir, stage)

    def result(self, stage: str) -> dict:
        """An earlier stage's result.json; refuses one that is missing or did not finish."""
        return run_folder.load_result(self.run_dir, stage)

    def save(self, figures: dict, headline: dict | None = None, artifacts: list[str] | None = None) -> dict:
        """This stage's result.json (run_folder.save_result): what it measured, its headline, what it made.
        Dtypes the params gave as auto, in the sections this stage reads, are recorded with the reason for the pick."""
        sections = params.stage_sections(self.name, self.p)  # its choices lie in sections it reads: the view has them
        choices = {k: c for k, c in self.p.dtype_choices.items() if k.split(".")[0] in sections}
        if choices:
            figures = {**figures, "dtype_auto": choices}
            picks = sorted({c["picked"] for c in choices.values()})
            headline = {**(headline or {}), "dtype (auto)": ", ".join(picks)}
        return run_folder.save_result(self.run_dir, self.name, figures, headline, artifacts)

    def save_partial(self, figures: dict) -> dict:
        """What the stage measured before it was stopped (an engine died, Ctrl-C), as its result.json with status
        'partial': the pipeline keeps these figures in the failed stage's result, and the next run redoes it."""
        result = run_folder.save_result(self.run_dir, self.name, figures)
        result["status"] = "partial"
        run_folder.write_json(self.out / "result.json", result)
        return result


def open_stage(name: str, params_file: str | Path, run_dir: str | Path | None = None, overrides: dict | None = None):
    """The run's params (params_file with overrides) as this stage sees them (params.stage_view: a section outside
    its hash raises when read), its run folder (default: outputs/<run.name>) and this stage's folder in it, made if
    missing. The run folder is held first (hold_run_folder): RunFolderBusy, before anything is made, where another
    process holds it."""
    overrides = overrides or {}
    p = params.load_params(params_file, overrides)
    run_dir = Path(run_dir) if run_dir else params.run_dir(p)
    hold_run_folder(name, run_dir)
    stage = Stage(
        name, params.stage_view(p, name), run_dir, run_folder.stage_dir(run_dir, name), overrides, all_params=p
    )
    print("stage folder:", stage.out)
    sections = params.stage_sections(name, p)
    for key, choice in p.dtype_choices.items():
        if key.split(".")[0] in sections:
            print(f"{key}: auto -> {choice['picked']}: {choice['why']}")
    return stage


def hold_run_folder(name: str, run_dir: Path) -> dict:
    """The run folder's lock for this stage's writes: the pipeline's, where it started this kernel while it holds
    the folder; else this process's own, held until it exits (a notebook opened by hand in JupyterLab: until its
    kernel is shut down), so that a CLI run or another notebook cannot write the same stages meanwhile. Raises
    run_folder.RunFolderBusy, naming the holder and what to do, where another live process holds it."""
    if "ipykernel" in sys.modules:
        command = f"notebook {name} opened by hand; its kernel holds the folder until it is shut down"
    else:
        command = f"open_stage({name!r}) in {' '.join(sys.argv) or 'python'}"
    holder = run_folder.hold_while_alive(run_dir, command, kernel="ipykernel" in sys.modules)
    if holder["by"] == "taken now":
        until = "this notebook's kernel" if "ipykernel" in sys.modules else "this process"
        print(f"run folder held by {until} (pid {holder['pid']}) until it exits: {run_dir / run_folder.LOCK_FILE}")
    return holder
