"""A run whose disk fills while a stage runs: the terminal says the disk is full and names the file being written
(never a damaged notebook), nothing written before is lost, and after the filler is removed the same command
finishes. Run folders on a small tmpfs (root only: skipped elsewhere), filled by another writer (small_disk.fill)."""

import hashlib
import shutil
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook
from small_disk import fill_when, mount_tmpfs, says, unmount

from eagle3lib.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / "tests" / "params" / "ci.yaml"


@pytest.fixture
def small_disk(tmp_path):
    disk = mount_tmpfs(tmp_path / "disk", 192)  # a SmolLM2 drafter's checkpoint is 72 MB
    yield disk
    unmount(disk)


def run(params: Path, disk: Path, to: str, capsys, **overrides) -> tuple[int, str]:
    """`python -m eagle3lib run params --to STAGE --set run.output_root=disk ...`: (exit code, what it printed)."""
    sets = [f"run.output_root={disk}", *(f"{k}={v}" for k, v in overrides.items())]
    capsys.readouterr()
    code = main(["run", str(params), "--to", to, *[a for s in sets for a in ("--set", s)]])
    out = capsys.readouterr()
    return code, out.out + out.err


def says_the_disk_is_full(printed: str, stage_dir: Path) -> None:
    """The error line says the disk is full and names a file in the stage's folder; never a damaged notebook."""
    error = next(line for line in printed.splitlines() if line.startswith("error:"))
    assert f"the disk is full while writing {stage_dir}" in error, printed
    assert "df -h" in error and "not appear to be JSON" not in printed
    for notebook in stage_dir.glob("*.ipynb"):  # the executed notebook on disk is a whole one
        nbformat.read(notebook, as_version=4)


# The first run's cell fills the disk (small_disk.fill, in the kernel) and ends; a rerun's does not.
FILLS_ONCE = """
from pathlib import Path
from eagle3lib import run_folder
if not Path(run_dir, "filled").exists():
    Path(run_dir, "filled").touch()
    block = b"0" * (1 << 20)
    with open(Path(run_dir).parent / "filler-in-kernel", "wb", buffering=0) as f:
        while block:
            try:
                f.write(block)
            except OSError:
                block = block[: len(block) // 2]
run_folder.save_result(run_dir, "00_only", {"n": 1})
"""


def test_a_notebook_saved_onto_a_full_disk_is_named_and_the_rerun_finishes(small_disk, tmp_path, capsys):
    """The stage's cell ends with the disk full, so papermill's save of the executed notebook is what fails."""
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    nb = new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    params = new_code_cell("params_file = None\nrun_dir = None\noverrides = {}")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [
        params,
        new_code_cell(FILLS_ONCE),
    ]
    nbformat.write(nb, nbs / "00_only.ipynb")
    params_file = tmp_path / "t.yaml"
    params_file.write_text("run: {name: t}\n")
    from eagle3lib.workbook import pipeline

    def cli():
        capsys.readouterr()
        try:
            pipeline.run_pipeline(
                params_file, {"run.output_root": str(small_disk)}, notebooks_dir=nbs, log_output=False
            )
            return ""
        except pipeline.StageError as e:
            return f"error: {e}"

    stage_dir = small_disk / "t" / "00_only"
    printed = cli()
    says_the_disk_is_full(printed, stage_dir)
    for filler in small_disk.glob("filler-*"):
        filler.unlink()
    assert cli() == "" and (stage_dir / "result.json").is_file()


def copy_in(ci_run_dir: Path, disk: Path, stage: str, *leave_out: str) -> Path:
    """ci_run's stage folder copied into the run folder on disk, less the files named by leave_out's patterns."""
    return shutil.copytree(ci_run_dir / stage, disk / "ci" / stage, ignore=shutil.ignore_patterns(*leave_out))


def shard_bytes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*/shard_*.safetensors"))}


@pytest.mark.slow
def test_a_disk_filled_while_extract_runs_is_named_and_the_rerun_equals_a_clean_one(ci_run, small_disk, capsys):
    """The extraction copied in, less its last shard, which this run captures; the disk fills while it does."""
    run_dir, overrides = ci_run
    copy_in(run_dir, small_disk, "00_prepare")
    stage_dir = copy_in(run_dir, small_disk, "01_extract", "01_extract.*", "result.json")
    max((stage_dir / "train").glob("shard_*.safetensors")).unlink()
    # filled once the stage has checked the disk's space for the missing shard, while it captures it
    filled = fill_when(small_disk, says(stage_dir / "01_extract.log", f"bytes free in {stage_dir / 'train'}"))
    # without the timed plain forward (minutes on 2 cores), which no shard depends on
    settings = {"run.cache_dir": overrides["run.cache_dir"], "extract.forward_benchmark_batches": 0}
    code, printed = run(CI, small_disk, "extract", capsys, **settings)
    filled["thread"].join()
    assert code == 1
    says_the_disk_is_full(printed, stage_dir)
    filled["filler"].unlink()
    code, printed = run(CI, small_disk, "extract", capsys, **settings)
    assert code == 0, printed
    assert shard_bytes(stage_dir) == shard_bytes(run_dir / "01_extract")


@pytest.mark.slow
def test_a_disk_filled_as_train_starts_is_named_and_the_rerun_finishes(ci_run, small_disk, capsys):
    """The earlier stages copied in, and training's last checkpoint, which the rerun resumes from."""
    run_dir, overrides = ci_run
    copy_in(run_dir, small_disk, "00_prepare")
    copy_in(run_dir, small_disk, "01_extract")
    older = [p.name for p in sorted((run_dir / "02_train" / "checkpoints").glob("step_*"))[:-1]]
    stage_dir = copy_in(run_dir, small_disk, "02_train", "02_train.*", "result.json", *older)
    filled = fill_when(small_disk, lambda: (stage_dir / "02_train.ipynb").exists())  # papermill's first save
    code, printed = run(CI, small_disk, "train", capsys, **{"run.cache_dir": overrides["run.cache_dir"]})
    filled["thread"].join()
    assert code == 1 and "01_extract: unchanged, skipped" in printed
    says_the_disk_is_full(printed, stage_dir)
    filled["filler"].unlink()
    code, printed = run(CI, small_disk, "train", capsys, **{"run.cache_dir": overrides["run.cache_dir"]})
    assert code == 0, printed
    assert "02_train: done" in printed and (stage_dir / "result.json").is_file()
