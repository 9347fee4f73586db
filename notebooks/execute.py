"""Executes the notebooks in place, so that the stored copies show their outputs.

Usage: ``.venv/bin/python notebooks/execute.py [NOTEBOOK ...]`` (all by default).

The kernel is this interpreter (checked), with ``MPLBACKEND=Agg``; the notebooks
display their figures as PNG images themselves.
"""

from __future__ import annotations

import argparse
import base64
import copy
import os
import pathlib
import sys

try:
    import nbclient
    import nbformat
except ImportError as error:  # `make demo` installs only the demo's extra
    raise SystemExit(
        f"{error}: executing the notebooks needs the development tools; run "
        "`make install` (or `pip install -e '.[dev]'`) first"
    ) from None

HERE = pathlib.Path(__file__).resolve().parent
NOTEBOOKS = sorted(HERE.glob("[0-9][0-9]_*.ipynb"))

_PROBE = "import sys\nprint(sys.executable)"


def execute(path: os.PathLike | str, timeout: int = 300) -> nbformat.NotebookNode:
    """Runs the notebook at ``path`` and returns it with fresh outputs.

    Raises ``nbclient.exceptions.CellExecutionError`` if a cell fails, and
    ``RuntimeError`` if the kernel is not running this Python interpreter.
    """
    path = pathlib.Path(path)
    nb = nbformat.read(path, as_version=4)
    run = copy.deepcopy(nb)
    # A first cell that reports the kernel's interpreter; removed afterwards.
    run.cells.insert(0, nbformat.v4.new_code_cell(_PROBE))
    client = nbclient.NotebookClient(
        run,
        kernel_name="python3",
        timeout=timeout,
        resources={"metadata": {"path": str(path.parent)}},
        # The kernel logs errors only: its start-up warning (that it listens on
        # TCP without encryption, on this machine only, for this run) would
        # otherwise be printed with every notebook.
        extra_arguments=["--IPKernelApp.log_level=ERROR"],
    )
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONHASHSEED": "0"}
    client.execute(env=env)
    probe = run.cells.pop(0)
    kernel_python = "".join(o.get("text", "") for o in probe.outputs).strip()
    if os.path.realpath(kernel_python) != os.path.realpath(sys.executable):
        raise RuntimeError(
            f"the notebook kernel runs {kernel_python!r}, not {sys.executable!r}"
        )
    for i, cell in enumerate(run.cells):
        # Timestamps would change the stored file on every run.
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.execution_count = sum(
                c.cell_type == "code" for c in run.cells[: i + 1]
            )
            for output in cell.outputs:
                if "execution_count" in output:
                    output["execution_count"] = cell.execution_count
    run.metadata = nb.metadata
    return run


def store_figure(nb: nbformat.NotebookNode, path: pathlib.Path) -> None:
    """Rewrites ``path`` (a figure the README shows as a file) from the
    notebook's one PNG output, so that the two stay the same."""
    pngs = [
        base64.b64decode(out["data"]["image/png"])
        for cell in nb.cells
        for out in cell.get("outputs", [])
        if "image/png" in out.get("data", {})
    ]
    if len(pngs) != 1:
        raise RuntimeError(f"{path} needs one figure in its notebook, got {len(pngs)}")
    path.write_bytes(pngs[0])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="notebooks/execute.py",
        description="Executes the notebooks in place (all by default).",
    )
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path, metavar="NOTEBOOK")
    paths = parser.parse_args(argv).notebooks or NOTEBOOKS
    for path in paths:
        if not path.is_file():
            parser.error(f"no notebook at {str(path)!r}")
    for path in paths:
        print(f"executing {path}", flush=True)
        nb = execute(path)
        nbformat.write(nb, path)
        if (figure := path.with_suffix(".png")).exists():
            store_figure(nb, figure)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
