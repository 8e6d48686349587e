"""What a failed stage says: the failing cell's error, else papermill's own (a kernel that never answered)."""

import nbformat
from nbformat.v4 import new_code_cell, new_notebook, new_output

from eagle3lib.workbook.kernels import KERNEL_START_TIMEOUT_S
from eagle3lib.workbook.pipeline import notebook_error


def test_the_failing_cells_error_comes_first(tmp_path):
    nb = new_notebook(cells=[new_code_cell("1"), new_code_cell("x")])
    nb.cells[1].outputs = [new_output("error", ename="NameError", evalue="name 'x' is not defined", traceback=[])]
    path = tmp_path / "02_train.ipynb"
    nbformat.write(nb, path)
    assert notebook_error(path, RuntimeError("papermill's")) == "NameError: name 'x' is not defined"


def test_without_a_failing_cell_papermills_error_is_told(tmp_path):
    """A GPU run once lost a training to 'unknown error': its kernel did not answer in papermill's 60 s."""
    path = tmp_path / "02_train.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell("1")]), path)
    raised = RuntimeError("Kernel didn't respond in 60 seconds")
    assert notebook_error(path, raised) == "RuntimeError: Kernel didn't respond in 60 seconds"
    assert (
        notebook_error(tmp_path / "never-written.ipynb", raised) == "RuntimeError: Kernel didn't respond in 60 seconds"
    )
    assert KERNEL_START_TIMEOUT_S >= 300  # a loaded host's kernel starts late, not never
