"""The notebooks run, end in their claim, and are stored with their outputs."""

import base64
import importlib.util
import pathlib
import re
import sys

import nbformat
import pytest

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NAMES = [
    "01_why_mean_of_means_is_wrong.ipynb",
    "02_precision.ipynb",
    "03_training_with_flax.ipynb",
    "04_noise_scale.ipynb",
    "05_token_windows.ipynb",
]

pytestmark = pytest.mark.slow


def _load_executor():
    spec = importlib.util.spec_from_file_location(
        "notebooks_execute", NOTEBOOK_DIR / "execute.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def _check_outputs(nb) -> None:
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "no code cells"
    for cell in code:
        assert cell.execution_count is not None, cell.source[:80]
        assert not [o for o in cell.outputs if o.output_type == "error"], cell.source
        # A cell that draws calls `show(fig)` at the top level (not its `def`).
        if re.search(r"^show\(fig\)", cell.source, re.MULTILINE):
            pngs = [o for o in cell.outputs if "image/png" in o.get("data", {})]
            assert len(pngs) == 1, f"no stored plot for: {cell.source[:80]}"
    assert sum(bool(re.search(r"^show\(fig\)", c.source, re.M)) for c in code) >= 1
    last = code[-1]
    assert "assert" in last.source
    assert "claim holds" in _text(last)


def test_notebook_list_is_complete():
    stored = sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb"))
    assert stored == NAMES
    assert [p.name for p in _load_executor().NOTEBOOKS] == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_stored_notebook_has_outputs(name):
    _check_outputs(nbformat.read(NOTEBOOK_DIR / name, as_version=4))


@pytest.mark.parametrize("name", NAMES)
def test_notebook_executes_and_its_claim_holds(name):
    # Raises CellExecutionError if any cell (the final assert included) fails,
    # and RuntimeError if the kernel is not this interpreter.
    nb = _load_executor().execute(NOTEBOOK_DIR / name, timeout=240)
    _check_outputs(nb)
    stored = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    # Same cells as stored: the stored rendering comes from this source.
    assert [c.source for c in nb.cells] == [c.source for c in stored.cells]


def test_readme_figure_is_the_stored_notebooks_figure():
    # The README shows notebook 05's figure as a file; it must be the one the
    # stored notebook holds (notebooks/execute.py re-stores both together).
    nb = nbformat.read(NOTEBOOK_DIR / "05_token_windows.ipynb", as_version=4)
    pngs = [
        base64.b64decode(out["data"]["image/png"])
        for cell in nb.cells
        for out in cell.get("outputs", [])
        if "image/png" in out.get("data", {})
    ]
    assert len(pngs) == 1
    assert (NOTEBOOK_DIR / "05_token_windows.png").read_bytes() == pngs[0]
    readme = (NOTEBOOK_DIR.parent / "README.md").read_text(encoding="utf-8")
    assert "](notebooks/05_token_windows.png)" in readme


class _Kernel:
    """Stands for ``nbclient.NotebookClient``: "runs" each code cell as a
    kernel reports it (its own execution counts, timestamps in the cell
    metadata, its language_info in the notebook metadata); the interpreter
    probe prints ``python``."""

    def __init__(self, nb, python, **kwargs):
        self.nb, self.python = nb, python

    def execute(self, env=None):
        self.nb.metadata["language_info"] = {"name": "python", "version": "0.0"}
        code = [c for c in self.nb.cells if c.cell_type == "code"]
        for n, cell in enumerate(code, start=7):
            cell.metadata["execution"] = {"iopub.status.idle": "2000-01-01T00:00:0"}
            cell.execution_count = n
            if "sys.executable" in cell.source:
                out = nbformat.v4.new_output("stream", name="stdout", text=self.python)
            else:
                out = nbformat.v4.new_output(
                    "execute_result", data={"text/plain": "1"}, execution_count=n
                )
            cell.outputs = [out]
        return self.nb


def _notebook(path, *cells):
    kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": kernelspec})
    nb.cells = list(cells)
    nbformat.write(nb, path)
    return nb


def _png_cell(data: bytes):
    cell = nbformat.v4.new_code_cell("show(fig)", execution_count=1)
    png = base64.b64encode(data).decode()
    cell.outputs = [nbformat.v4.new_output("display_data", data={"image/png": png})]
    return cell


def test_execute_stores_the_cells_as_written_numbered_from_one(tmp_path, monkeypatch):
    executor = _load_executor()
    path = tmp_path / "01_x.ipynb"
    stored = _notebook(
        path,
        nbformat.v4.new_markdown_cell("# title"),
        nbformat.v4.new_code_cell("a = 1"),
        nbformat.v4.new_markdown_cell("text"),
        nbformat.v4.new_code_cell("a + 1"),
    )
    monkeypatch.setattr(
        executor.nbclient,
        "NotebookClient",
        lambda nb, **kwargs: _Kernel(nb, sys.executable, **kwargs),
    )
    nb = executor.execute(path)
    # The interpreter probe is gone; the cells are the stored ones.
    assert [c.source for c in nb.cells] == [c.source for c in stored.cells]
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == [1, 2]
    assert [c.outputs[0]["execution_count"] for c in code] == [1, 2]
    # Nothing that changes from run to run: no timestamps, the stored metadata.
    assert all("execution" not in c.metadata for c in nb.cells)
    assert nb.metadata == stored.metadata


def test_execute_refuses_a_kernel_of_another_interpreter(tmp_path, monkeypatch):
    executor = _load_executor()
    path = tmp_path / "01_x.ipynb"
    _notebook(path, nbformat.v4.new_code_cell("a = 1"))
    monkeypatch.setattr(
        executor.nbclient,
        "NotebookClient",
        lambda nb, **kwargs: _Kernel(nb, "/usr/bin/python0", **kwargs),
    )
    with pytest.raises(RuntimeError, match="/usr/bin/python0"):
        executor.execute(path)


def test_main_stores_the_executed_notebook_and_its_figure(tmp_path, monkeypatch):
    executor = _load_executor()
    with_figure, without = tmp_path / "01_a.ipynb", tmp_path / "02_b.ipynb"
    for path in (with_figure, without):
        _notebook(path, nbformat.v4.new_code_cell("show(fig)"))
    figure = with_figure.with_suffix(".png")
    figure.write_bytes(b"an old figure")

    def execute(path):
        nb = nbformat.read(path, as_version=4)
        nb.cells = [_png_cell(b"the figure of " + path.name.encode())]
        return nb

    monkeypatch.setattr(executor, "execute", execute)
    assert executor.main([str(with_figure), str(without)]) == 0
    for path in (with_figure, without):
        (cell,) = nbformat.read(path, as_version=4).cells
        assert cell.execution_count == 1 and cell.outputs, path
    assert figure.read_bytes() == b"the figure of 01_a.ipynb"
    assert not without.with_suffix(".png").exists()


def test_a_figure_file_is_refused_for_a_notebook_of_two_figures(tmp_path):
    executor = _load_executor()
    nb = nbformat.v4.new_notebook()
    nb.cells = [_png_cell(b"first"), _png_cell(b"second")]
    figure = tmp_path / "05_x.png"
    figure.write_bytes(b"as stored")
    with pytest.raises(RuntimeError, match="needs one figure in its notebook, got 2"):
        executor.store_figure(nb, figure)
    assert figure.read_bytes() == b"as stored"
