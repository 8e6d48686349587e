"""The run lock for stage notebooks opened by hand: a real kernel running a notebook's first cell (open_stage) on a
run folder that a CLI run holds is refused and writes nothing, even told (falsely) that its parent holds the lock; a
kernel that holds the folder refuses the CLI, and lets go when it is shut down. A notebook the pipeline runs works
under the pipeline's lock (tests/e2e/test_pipeline.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from jupyter_client.manager import start_new_kernel

from eagle3lib import run_folder

ROOT = Path(__file__).resolve().parents[2]
FIRST_CELL = 'from eagle3lib.workbook import open_stage\nstage = open_stage("02_train", {!r}, {!r}, {{}})'


@pytest.fixture
def run_params(tmp_path):
    """A params file whose run folder is tmp_path/outputs/t, and that folder."""
    params_file = tmp_path / "t.yaml"
    params_file.write_text(f"run: {{name: t, output_root: {tmp_path / 'outputs'}}}\n")
    return params_file, tmp_path / "outputs" / "t"


def kernel(env=None):
    """A python3 kernel (the one JupyterLab starts for the notebooks) with env, less the pipeline's variable."""
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if env or k != run_folder.HOLDER_ENV}
    return start_new_kernel(kernel_name="python3", cwd=str(ROOT / "notebooks"), env=env)


def run_cell(kc, code):
    """The cell's output as text (its streams, and its error's name and message) and whether it raised."""
    out = []

    def keep(msg):
        content = msg["content"]
        if msg["msg_type"] == "stream":
            out.append(content["text"])
        elif msg["msg_type"] == "error":
            out.append(f"{content['ename']}: {content['evalue']}")

    reply = kc.execute_interactive(code, output_hook=keep, timeout=180)
    return "".join(out), reply["content"]["status"] == "error"


def files_under(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def test_a_notebook_on_a_folder_a_cli_run_holds_says_so_and_writes_nothing(run_params):
    params_file, run_dir = run_params
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pathlib import Path\nfrom eagle3lib import run_folder\n"
         "with run_folder.locked(Path(sys.argv[1]), 'python -m eagle3lib run t.yaml'):\n"
         "    print('held', flush=True); time.sleep(600)", str(run_dir)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        before = files_under(run_dir)
        lock = json.loads((run_dir / run_folder.LOCK_FILE).read_text())
        # the pipeline's variable, naming the real holder: the kernel was not started by it, so it counts for nothing
        forged = {run_folder.HOLDER_ENV: json.dumps({"run_dir": str(run_dir.resolve()), **lock})}
        for env in (None, forged):
            km, kc = kernel(env)
            try:
                out, failed = run_cell(kc, FIRST_CELL.format(str(params_file), str(run_dir)))
            finally:
                kc.stop_channels()
                km.shutdown_kernel(now=True)
            assert failed and "RunFolderBusy" in out, out
            assert f"in use by pid {holder.pid} on " in out and "(python -m eagle3lib run t.yaml)" in out, out
            assert f"kill {holder.pid}" in out and "overrides={'run.name': ...}" in out, out
            assert files_under(run_dir) == before == [run_folder.LOCK_FILE]  # no stage folder, nothing else
            assert json.loads((run_dir / run_folder.LOCK_FILE).read_text()) == lock
    finally:
        holder.kill()
        holder.wait()


def test_a_notebook_kernel_holds_its_run_folder_against_the_cli_until_it_is_shut_down(run_params):
    params_file, run_dir = run_params
    km, kc = kernel()
    try:
        out, failed = run_cell(
            kc, FIRST_CELL.format(str(params_file), str(run_dir)) + "\nimport os; print(os.getpid())"
        )
        assert not failed and (run_dir / "02_train").is_dir(), out
        pid = int(out.split()[-1])
        assert f"run folder held by this notebook's kernel (pid {pid})" in out, out
        again, failed = run_cell(kc, FIRST_CELL.format(str(params_file), str(run_dir)))  # the cell run twice
        assert not failed, again
        cli = subprocess.run(
            [sys.executable, "-m", "eagle3lib", "run", str(params_file)], cwd=ROOT, capture_output=True, text=True
        )
        assert cli.returncode == 3, cli.stderr
        assert f"in use by a notebook's kernel, pid {pid} on " in cli.stderr, cli.stderr
        assert "notebook 02_train opened by hand" in cli.stderr and "Kernel > Shut Down Kernel" in cli.stderr
        assert files_under(run_dir) == ["02_train", run_folder.LOCK_FILE]  # the CLI wrote nothing
    finally:
        kc.stop_channels()
        km.shutdown_kernel()  # as JupyterLab's "Shut Down Kernel": the kernel exits and lets go
    assert (run_dir / run_folder.LOCK_FILE).read_text() == ""
    with run_folder.locked(run_dir, "the next run") as me:
        assert me["pid"] == os.getpid()
