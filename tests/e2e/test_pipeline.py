"""The papermill pipeline on small real notebooks: order, skipping, forcing, failures, reports."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from eagle3lib import params as P
from eagle3lib import run_folder
from eagle3lib.workbook import open_stage, pipeline

STAGE_CODE = {
    "00_first": """
from eagle3lib.workbook import open_stage
stage = open_stage("00_first", params_file, run_dir, overrides)
p = stage.p
(stage.out / "made.txt").write_text(str(p.bench.max_tokens))
print("a line for the stage's log")
import base64
from IPython.display import Image, display
display(Image(base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")))
stage.save({"n": p.bench.max_tokens}, headline={"tokens": p.bench.max_tokens}, artifacts=["made.txt"])
""",
    "01_second": """
from eagle3lib import run_folder
from eagle3lib import params as P
p = P.load_params(params_file, overrides)
first = run_folder.load_result(run_dir, "00_first")
if p.bench.num_prompts == 13:
    raise ValueError("thirteen prompts are unlucky")
run_folder.save_result(run_dir, "01_second", {"twice": 2 * first["figures"]["n"]}, headline={"twice": 2 * first["figures"]["n"]})
""",
}


@pytest.fixture
def workbook(tmp_path):
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    for name, code in STAGE_CODE.items():
        nb = new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        params = new_code_cell("params_file = None\nrun_dir = None\noverrides = {}")
        params.metadata["tags"] = ["parameters"]
        nb.cells = [params, new_code_cell(code)]
        nbformat.write(nb, nbs / f"{name}.ipynb")
    params_file = tmp_path / "params" / "t.yaml"
    params_file.parent.mkdir()
    params_file.write_text("run: {output_root: ../outputs}\nbench: {max_tokens: 7}\n")
    return nbs, params_file, tmp_path / "outputs" / "t"


def run(workbook, **kw):
    nbs, params_file, _ = workbook
    return pipeline.run_pipeline(params_file, notebooks_dir=nbs, log_output=False, **kw)


def result(run_dir, stage):
    return json.loads((run_dir / stage / "result.json").read_text())


def test_stage_names():
    names = ["00_prepare", "01_extract"]
    assert pipeline.stage_name("extract", names) == "01_extract"
    assert pipeline.stage_name("00", names) == "00_prepare"
    with pytest.raises(ValueError, match="stages are: 00_prepare, 01_extract"):
        pipeline.stage_name("train", names)


def test_runs_in_order_then_skips_then_forces(workbook, capsys):
    out = run(workbook, to_stage="first")
    assert (out / "00_first" / "result.json").is_file() and not (out / "01_second" / "result.json").exists()
    out = run(workbook)
    first, second = result(out, "00_first"), result(out, "01_second")
    assert first["status"] == second["status"] == "ok"
    assert second["figures"] == {"twice": 14}
    for stage in ("00_first", "01_second"):
        assert (out / stage / f"{stage}.ipynb").is_file() and (out / stage / f"{stage}.html").is_file()
    run_json = json.loads((out / "run.json").read_text())
    assert run_json["params"]["bench"]["max_tokens"] == 7 and "torch" in run_json["versions"]
    index = (out / "index.html").read_text()
    assert "00_first/00_first.html" in index and "twice" in index

    assert "00_first: unchanged, skipped" in capsys.readouterr().err
    with pytest.raises(ValueError, match="nothing to run: 01_second comes after 00_first"):
        run(workbook, from_stage="second", to_stage="first")
    run(workbook)
    assert capsys.readouterr().err.count("unchanged, skipped") == 2
    assert result(out, "00_first")["hash"] == first["hash"]

    run(workbook, only_stage="second")
    err = capsys.readouterr().err
    assert "01_second: running" in err and "[eagle3] 00_first" not in err

    # A changed param reruns the stages that read it; a missing artifact reruns its stage.
    run(workbook, overrides={"bench.max_tokens": 8})
    assert result(out, "01_second")["figures"] == {"twice": 16}
    (out / "00_first" / "made.txt").unlink()
    capsys.readouterr()
    run(workbook, overrides={"bench.max_tokens": 8})
    assert "00_first: 1 of its files changed since it made them (made.txt: missing): running" in capsys.readouterr().err


def test_console_shows_stage_lines_the_log_keeps_the_cells(workbook, caplog, capsys):
    """By default the console has a line per stage and, at the end, each stage's time, the total and the machine;
    the cells' log (papermill's lines, the notebook's output) goes to NN_stage.log only. log_output (--verbose)
    echoes it too."""
    import logging

    caplog.set_level(logging.INFO)
    out = run(workbook)
    err = capsys.readouterr().err
    assert "[eagle3] 00_first: done in" in err and "stage times:" in err
    assert re.search(r"00_first +ok +\d+\.\d s", err) and re.search(r"total +\d+\.\d s \(\d+\.\d min\)", err)
    machine = json.loads((out / "run.json").read_text())["machine"]
    assert machine["cores"] >= 1 and f"{machine['cores']} cores" in err and "bf16" in err
    assert f"{machine['cores']} cores" in (out / "index.html").read_text()
    log = (out / "00_first" / "00_first.log").read_text()
    assert "Executing Cell" in log and "a line for the stage's log" in log
    # nbconvert's warning on the image without alternative text: in the log, not among the stage lines
    assert "Alternative text is missing on 1 image(s)." in log and "Alternative text" not in err
    assert not any("a line for the stage's log" in r.getMessage() for r in caplog.records)
    assert not any("Executing Cell" in r.getMessage() for r in caplog.records)
    caplog.clear()
    pipeline.run_pipeline(workbook[1], notebooks_dir=workbook[0], log_output=True, only_stage="first")
    assert any("a line for the stage's log" in r.getMessage() for r in caplog.records)


def test_failed_stage_keeps_traceback_and_earlier_work(workbook):
    with pytest.raises(pipeline.StageError):
        run(workbook, overrides={"bench.num_prompts": 13})
    out = workbook[2]
    made = (out / "00_first" / "made.txt").stat().st_mtime_ns
    with pytest.raises(pipeline.StageError, match=r"stage 01_second failed .*ValueError: thirteen prompts are unlucky"):
        run(workbook, overrides={"bench.num_prompts": 13})
    failed = result(out, "01_second")
    assert failed["status"] == "failed" and "thirteen" in failed["error"] and "hash" not in failed
    assert "thirteen prompts are unlucky" in (out / "01_second" / "01_second.html").read_text()
    assert (
        "Traceback" in (out / "01_second" / "01_second.ipynb").read_text()
        or "ValueError" in (out / "01_second" / "01_second.ipynb").read_text()
    )
    assert (out / "00_first" / "made.txt").stat().st_mtime_ns == made
    assert "thirteen prompts" in (out / "index.html").read_text()
    # The failed stage is not skipped next time, and a later stage refuses a failed input.
    with pytest.raises(RuntimeError, match="did not finish"):
        run_folder.load_result(out, "01_second")
    run(workbook)
    assert result(out, "01_second")["status"] == "ok"


def test_cli_exit_codes(workbook, tmp_path):
    nbs, params_file, _ = workbook
    bad = subprocess.run(
        [sys.executable, "-m", "eagle3lib", "run", str(params_file), "--only", "nosuchstage"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "unknown stage 'nosuchstage'" in bad.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "eagle3lib", "run", str(tmp_path / "none.yaml")], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "params file not found" in missing.stderr


def test_open_stage_reads_params_and_earlier_results_and_saves(tmp_path, capsys):
    """The notebooks' preamble: params with overrides, the run folder (given or from the params), this stage's
    folder, an earlier stage's folder and result (refused when missing or failed), this stage's result."""
    params_file = tmp_path / "params" / "t.yaml"
    params_file.parent.mkdir()
    params_file.write_text("run: {name: t, output_root: ../outputs}\nbench: {max_tokens: 7}\n")
    stage = open_stage("01_second", params_file, overrides={"bench.max_tokens": 9})
    assert stage.p.bench.max_tokens == 9 and stage.overrides == {"bench.max_tokens": 9}
    assert stage.run_dir == tmp_path / "outputs" / "t" and stage.out == stage.run_dir / "01_second"
    assert stage.out.is_dir() and f"stage folder: {stage.out}" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="run stage 00_first first"):
        stage.result("00_first")
    run_folder.save_result(stage.run_dir, "00_first", {"n": 3})
    assert stage.result("00_first")["figures"] == {"n": 3} and stage.folder("00_first") == stage.run_dir / "00_first"
    saved = stage.save({"twice": 6}, headline={"twice": 6}, artifacts=["x"])
    # train.dtype defaults to auto: a stage that reads train records the pick and why
    auto = stage.p.dtype_choices["train.dtype"]
    assert auto["picked"] in ("float32", "bfloat16") and auto["why"]
    assert (
        result(stage.run_dir, "01_second")
        == saved
        == {
            "stage": "01_second",
            "figures": {"twice": 6, "dtype_auto": {"train.dtype": auto}},
            "headline": {"twice": 6, "dtype (auto)": auto["picked"]},
            "artifacts": ["x"],
        }
    )
    # 04_deploy reads no train section: train's auto dtype is not its business
    assert "dtype_auto" not in open_stage("04_deploy", params_file).save({})["figures"]
    run_folder.write_json(stage.run_dir / "00_first" / "result.json", {"status": "failed", "error": "E: boom"})
    with pytest.raises(RuntimeError, match="did not finish .failed: E: boom"):
        stage.result("00_first")
    elsewhere = open_stage("01_second", params_file, tmp_path / "other")
    assert elsewhere.out == tmp_path / "other" / "01_second" and elsewhere.out.is_dir() and elsewhere.seconds >= 0


@pytest.mark.parametrize(
    ("stage", "change", "reruns"),
    [
        ("02_train", {"bench.prompts": ["mt_bench"]}, False),  # a bench change never retrains
        ("02_train", {"bench.depths": [3]}, False),
        ("02_train", {"engine.extra_args": ["--x"]}, False),
        ("02_train", {"extract.batch_tokens": 1024}, False),  # from shards: 01_extract's hash carries it
        ("02_train", {"train.lr": 2e-3}, True),
        ("02_train", {"run.seed": 1}, True),
        ("02_train", {"run.hide_code": True}, False),
        ("01_extract", {"engine.extra_args": ["--x"]}, False),  # hf: no engine
        ("01_extract", {"data.max_seq_len": 512}, False),  # 00_prepare's hash carries it
        ("00_prepare", {"engine.name": "sglang"}, False),  # no regeneration through the engine
        ("05_benchmark", {"bench.prompts": ["mt_bench"]}, True),
        ("05_benchmark", {"train.lr": 2e-3}, False),  # 02_train's hash carries it
    ],
)
def test_a_stage_hash_follows_the_sections_it_reads(tmp_path, stage, change, reruns):
    params_file = tmp_path / "t.yaml"
    params_file.write_text("run: {name: t}\n")
    before = pipeline.stage_hash(P.load_params(params_file), stage, tmp_path, [])
    assert (pipeline.stage_hash(P.load_params(params_file, change), stage, tmp_path, []) != before) == reruns


@pytest.mark.parametrize(
    ("choice", "change"),
    [
        ({"train.source": "online"}, {"extract.batch_tokens": 1024}),
        ({"train.source": "online", "extract.backend": "sglang_inprocess"}, {"engine.extra_args": ["--tp", "2"]}),
    ],
)
def test_02_train_online_hashes_the_capture_it_runs(tmp_path, choice, change):
    params_file = tmp_path / "t.yaml"
    params_file.write_text("run: {name: t}\n")
    before = pipeline.stage_hash(P.load_params(params_file, choice), "02_train", tmp_path, [])
    assert pipeline.stage_hash(P.load_params(params_file, choice | change), "02_train", tmp_path, []) != before
    # the same change from shards reads nothing of it
    shards = pipeline.stage_hash(P.load_params(params_file), "02_train", tmp_path, [])
    assert pipeline.stage_hash(P.load_params(params_file, change), "02_train", tmp_path, []) == shards


def test_open_stage_gives_the_stage_its_view_of_the_params(tmp_path):
    params_file = tmp_path / "params" / "t.yaml"
    params_file.parent.mkdir()
    params_file.write_text("run: {name: t, output_root: ../outputs}\n")
    stage = open_stage("02_train", params_file, overrides={"train.lr": 2e-3})
    assert stage.p.train.lr == 2e-3 and stage.cache_dir == P.cache_dir(stage.p) and stage.p.file == str(params_file)
    with pytest.raises(P.UnreadSectionError, match=r"02_train read params bench.depths.*STAGE_SECTIONS\['02_train'\]"):
        _ = stage.p.bench.depths
    assert stage.save({"n": 1})["figures"]["n"] == 1


# ------------------------------------------------------- what a run trusts ----


def test_a_plain_run_redoes_a_stage_whose_files_changed(workbook, capsys):
    """A skipped stage is checked first: a file it made with other bytes (same size), cut short or gone makes the
    stage run again, with a line naming the file; a later stage with the same inputs stays skipped."""
    out = run(workbook)
    made = out / "00_first" / "made.txt"
    for damage, said in [
        (lambda: made.write_text("8"), "made.txt: other bytes than when made"),  # '7' -> '8': the same size
        (lambda: made.write_text(""), "made.txt: 0 bytes, 1 when made"),
        (made.unlink, "made.txt: missing"),
    ]:
        damage()
        capsys.readouterr()
        run(workbook)
        err = capsys.readouterr().err
        assert f"00_first: 1 of its files changed since it made them ({said}): running it again" in err, err
        assert made.read_text() == "7" and "01_second: unchanged, skipped" in err
    run(workbook)
    assert capsys.readouterr().err.count("unchanged, skipped") == 2


def test_a_second_run_on_a_held_folder_is_refused_and_a_dead_holders_lock_is_taken(workbook, caplog):
    out = run(workbook)
    made = (out / "00_first" / "made.txt").stat().st_mtime_ns
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pathlib import Path\nfrom eagle3lib import run_folder\n"
         "with run_folder.locked(Path(sys.argv[1]), 'make run in another terminal'):\n"
         "    print('held', flush=True); time.sleep(600)", str(out)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(run_folder.RunFolderBusy, match=rf"in use by pid {holder.pid} on .*make run in another"):
            run(workbook, from_stage="first")  # forced: without the lock it would rewrite the first run's files
        assert (out / "00_first" / "made.txt").stat().st_mtime_ns == made
    finally:
        holder.kill()
        holder.wait()
    with caplog.at_level("WARNING"):
        run(workbook, from_stage="first")
    assert f"took over the lock of pid {holder.pid}" in caplog.text
    assert (out / "00_first" / "made.txt").stat().st_mtime_ns != made
    assert (out / run_folder.LOCK_FILE).read_text() == ""  # let go at the end


def test_a_torn_result_json_counts_as_not_run(workbook, capsys):
    out = run(workbook)
    (out / "00_first" / "result.json").write_text('{"stage": "00_fi')  # a kill or a full disk while it was written
    with pytest.raises(FileNotFoundError, match=r"00_first/result.json does not read: run stage 00_first first"):
        run_folder.load_result(out, "00_first")
    capsys.readouterr()
    run(workbook)
    err = capsys.readouterr().err
    assert "00_first: running" in err and result(out, "00_first")["status"] == "ok"


def test_cli_names_what_to_fix_for_a_bad_value_or_a_path(workbook, tmp_path):
    _, params_file, _ = workbook
    bad = subprocess.run(
        [sys.executable, "-m", "eagle3lib", "run", str(params_file), "--set", "train.lr=[1,"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode == 2 and "train.lr is not valid YAML" in bad.stderr and "Traceback" not in bad.stderr
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    where = subprocess.run(
        [sys.executable, "-m", "eagle3lib", "run", str(params_file), "--set", f"run.output_root={blocked}"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert where.returncode == 2 and str(blocked) in where.stderr and "Traceback" not in where.stderr, where.stderr


# A stand-in for torchrun: it starts a worker in a session of its own, as torch's elastic agent does, and stops it
# on SIGTERM or SIGINT
LAUNCHER = """
import os, signal, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: time.sleep(0.2)"], start_new_session=True)
def stop(*_):
    os.killpg(worker.pid, signal.SIGTERM)
    worker.wait()
    sys.exit(1)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
open(sys.argv[1], "w").write(f"{os.getpid()} {worker.pid}")
while True:
    time.sleep(0.2)
"""

LONG_STAGE = """
import os, sys
from eagle3lib.workbook import open_stage
from eagle3lib.engines.server import run_guarded
stage = open_stage("00_first", params_file, run_dir, overrides)
(stage.out / "kernel.pid").write_text(str(os.getpid()))
try:
    run_guarded([sys.executable, "-c", LAUNCHER, str(stage.out / "launched.pids")])
except KeyboardInterrupt:
    stage.save_partial({"rows": [{"config": "baseline"}], "missing": [{"config": "depth1", "why": "interrupted"}]})
    raise
"""

DRIVER = """
import sys
from pathlib import Path
from eagle3lib.workbook import pipeline
try:
    pipeline.run_pipeline(sys.argv[1], notebooks_dir=Path(sys.argv[2]), log_output=False)
except KeyboardInterrupt as e:
    print("interrupted:", e, file=sys.stderr)
    sys.exit(130)
"""


@pytest.fixture
def long_stage(tmp_path):
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = new_code_cell("params_file = None\nrun_dir = None\noverrides = {}")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, new_code_cell(f"LAUNCHER = {LAUNCHER!r}\n" + LONG_STAGE)]
    nbformat.write(nb, nbs / "00_first.ipynb")
    params_file = tmp_path / "t.yaml"
    params_file.write_text("run: {output_root: outputs}\n")
    return params_file, nbs, tmp_path / "outputs" / "t" / "00_first"


def start_and_wait_for_the_launch(long_stage, ignore_sigint=False):
    """The pipeline in a session of its own, as a terminal runs it (SIGINT ignored: as a shell's background job);
    returns it with the kernel's, the launcher's and its worker's pids once the worker runs."""
    params_file, nbs, stage_dir = long_stage
    run = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(params_file), str(nbs)], start_new_session=True, stderr=subprocess.PIPE,
        text=True, preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None,
    )  # fmt: skip
    launched = stage_dir / "launched.pids"
    deadline = time.time() + 120
    while not launched.is_file() or len(launched.read_text().split()) < 2:
        assert time.time() < deadline and run.poll() is None, run.stderr.read() if run.poll() is not None else "late"
        time.sleep(0.2)
    return run, [int((stage_dir / "kernel.pid").read_text()), *map(int, launched.read_text().split())]


def gone(pids, within_s):
    deadline = time.time() + within_s
    while time.time() < deadline:
        if not any(Path(f"/proc/{pid}").exists() and not zombie(pid) for pid in pids):
            return True
        time.sleep(0.2)
    return False


def zombie(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("ignore_sigint", [False, True], ids=["terminal", "background-job"])
def test_ctrl_c_stops_the_run_within_seconds_and_keeps_what_was_measured(long_stage, ignore_sigint):
    run, pids = start_and_wait_for_the_launch(long_stage, ignore_sigint)
    t0 = time.time()
    os.killpg(run.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
    try:
        code = run.wait(timeout=20)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert code == 130 and time.time() - t0 < 12, run.stderr.read()
    assert gone(pids, within_s=5), pids  # the kernel, the launcher and the worker in its own session
    r = json.loads((long_stage[2] / "result.json").read_text())
    assert r["status"] == "failed" and r["partial"] and "KeyboardInterrupt" in r["error"]
    assert r["figures"]["rows"] == [{"config": "baseline"}] and r["figures"]["missing"][0]["config"] == "depth1"
    page = (long_stage[2] / "00_first.html").read_text()
    assert "Kept in result.json: 1 rows measured before it stopped (baseline). Missing: depth1, interrupted" in page
    assert (long_stage[2].parent / run_folder.LOCK_FILE).read_text() == ""


def test_a_killed_run_leaves_no_worker(long_stage):
    """kill -9 of the run: no finally runs in it; the kernel goes with its parent, the guard with the kernel, and
    the launcher stops its worker."""
    run, pids = start_and_wait_for_the_launch(long_stage)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    assert gone(pids, within_s=30), [p for p in pids if Path(f"/proc/{p}").exists()]
