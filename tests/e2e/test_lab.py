"""Interactive use: the notebooks' defaults point at the embedded default, the 'python3' kernel is this
environment, and a stage notebook runs top to bottom in a real JupyterLab with working widgets."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from eagle3lib import params as P
from eagle3lib import run_folder

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def parameters_cell(path):
    nb = nbformat.read(path, as_version=4)
    return next(c.source for c in nb.cells if "parameters" in c.metadata.get("tags", []))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_defaults_are_the_embedded_default_and_the_cli_run_folder(path, monkeypatch):
    """Run interactively (cwd notebooks/, as JupyterLab does), a notebook reads and writes what
    `python -m eagle3lib run params/smollm2-135m-cpu.yaml` does."""
    monkeypatch.chdir(ROOT / "notebooks")
    names = {}
    exec(parameters_cell(path), names)
    assert Path(names["params_file"]).resolve() == ROOT / "params" / "smollm2-135m-cpu.yaml"
    assert names["run_dir"] is None and names["overrides"] == {}
    p = P.load_params(names["params_file"], names["overrides"])
    assert p.target.name == P.EMBEDDED_TARGET and p.data.sources == [P.EMBEDDED_DATA]
    assert (
        P.run_dir(p) == P.run_dir(P.load_params(ROOT / "params" / "smollm2-135m-cpu.yaml")) == ROOT / "outputs" / "tiny"
    )


def test_the_python3_kernel_is_this_environment():
    """The kernel the notebooks name imports eagle3lib and ipywidgets from this environment."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(ROOT / "notebooks"))
    try:
        out = []
        kc.execute_interactive(
            "import sys, eagle3lib, ipywidgets; print(sys.prefix, eagle3lib.__file__)",
            output_hook=lambda m: out.append(m["content"].get("text", "")),
            timeout=120,
        )
        prefix, module = "".join(out).split()
        assert Path(prefix) == Path(sys.prefix) and Path(module).parent == ROOT / "eagle3lib"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_make_lab_opens_jupyterlab_on_the_notebooks():
    plan = subprocess.run(["make", "-n", "lab"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "ipykernel install --sys-prefix --name python3" in plan
    assert "jupyter lab --notebook-dir=notebooks --ServerApp.ip=127.0.0.1" in plan


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_train_notebook_runs_in_jupyterlab_and_its_slider_works(ci_run, tmp_path):
    """02_train, pointed at a copy of the ci run, run with 'Run All' in JupyterLab (headless Chromium): it
    finishes without an error (training resumes from its final checkpoint) and the validation slider
    re-renders the accuracy view."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from test_browser import chromium

    run_dir = tmp_path / "outputs" / "ci"
    shutil.copytree(ci_run[0], run_dir)
    nb = nbformat.read(ROOT / "notebooks" / "02_train.ipynb", as_version=4)
    for cell in nb.cells:
        if "parameters" in cell.metadata.get("tags", []):
            cell.source = (
                f'params_file = "{ROOT / "tests" / "params" / "ci.yaml"}"\nrun_dir = "{run_dir}"\n'
                f'overrides = {{"run.output_root": "{run_dir.parent}", "run.cache_dir": "{ci_run[1]["run.cache_dir"]}"}}'
            )
    work = tmp_path / "lab"
    work.mkdir()
    nbformat.write(nb, work / "02_train.ipynb")
    port = free_port()
    lab = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            f"--port={port}",
            "--allow-root",
            "--IdentityProvider.token=t",
            f"--notebook-dir={work}",
            "--ServerApp.ip=127.0.0.1",
            "--LabApp.expose_app_in_browser=True",
        ],
        stdout=open(work / "lab.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    driver = chromium()
    try:
        app = "window.jupyterapp"
        kernel = f"{app}.shell.currentWidget.sessionContext.session?.kernel"
        deadline = time.time() + 120
        while True:  # the server, then the notebook with an idle kernel
            try:
                driver.get(f"http://127.0.0.1:{port}/lab/tree/02_train.ipynb?token=t")
                break
            except Exception:
                if time.time() > deadline:
                    raise
                time.sleep(2)
        while driver.execute_script(
            f"return !({app} && {app}.shell.currentWidget?.sessionContext && {kernel}?.status === 'idle')"
        ):
            assert time.time() < deadline, (
                "JupyterLab did not open the notebook with an idle kernel: " + (work / "lab.log").read_text()[-2000:]
            )
            time.sleep(1)
        driver.execute_script(f"{app}.commands.execute('notebook:run-all-cells')")
        deadline = time.time() + 600
        while True:
            time.sleep(2)
            prompts = driver.execute_script(
                "return [...document.querySelectorAll('.jp-InputPrompt')].map(e => e.textContent)"
            )
            if driver.execute_script(f"return {kernel}.status") == "idle" and not any("*" in p for p in prompts):
                break
            assert time.time() < deadline, prompts
        errors = driver.execute_script(
            "return [...document.querySelectorAll('.jp-OutputArea-output')]"
            ".map(e => e.innerText).filter(t => t.includes('Traceback'))"
        )
        assert not errors, errors[0][:2000]
        views = lambda: driver.execute_script(  # noqa: E731
            "return [...document.querySelectorAll('.widget-html-content')].map(e => e.innerHTML)"
        )
        before = views()
        assert len(before) == 1 and "step_acc" in before[0]
        handle = driver.find_element(By.CSS_SELECTOR, ".widget-slider .noUi-handle")
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", handle)
        handle.click()
        handle.send_keys(Keys.HOME)  # the first validation
        deadline = time.time() + 30
        while views() == before:
            assert time.time() < deadline, "the slider did not change the view"
            time.sleep(0.5)
        assert "validation at" in driver.find_element(By.TAG_NAME, "body").text
        (ci_run[0] / "screenshots").mkdir(exist_ok=True)
        driver.save_screenshot(str(ci_run[0] / "screenshots" / "lab-02_train.png"))
    finally:
        driver.quit()
        os.killpg(lab.pid, signal.SIGTERM)
        lab.wait(30)
    assert (
        run_folder.load_result(run_dir, "02_train")["figures"]["eval"]
        == run_folder.load_result(ci_run[0], "02_train")["figures"]["eval"]
    )  # the same result as the papermill run
