"""docs/notebook.ipynb runs from top to bottom, on a shorter training than the one it shows.

`python -m tests.test_notebook` runs it as it is and writes it back with its outputs.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from .console import REPO

NOTEBOOK = REPO / "docs" / "notebook.ipynb"
TRAINING = '"train.max_minutes": 1'
RUN = '"runs/notebook"'


def execute(nb, timeout: int = 600) -> None:
    """Run every cell of `nb` in a fresh kernel, from the repository root, on this checkout."""
    from nbclient import NotebookClient

    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])
    )
    NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}
    ).execute()


def test_the_notebook_runs(tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert sum(TRAINING in c.source and RUN in c.source for c in code) == 1
    for cell in code:  # a quarter of a minute's training, into a directory of its own
        cell.source = cell.source.replace(TRAINING, '"train.max_minutes": 0.25')
        cell.source = cell.source.replace(RUN, repr(str(tmp_path / "run")))
    execute(nb)
    shown = [o for c in code for o in c.outputs]
    assert not [o for o in shown if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in shown) == 3  # attention, trace, curves
    text = "".join(o.get("text", "") for o in shown)
    assert "total" in text and "Who is I?" in text
    assert (tmp_path / "run" / "best.pt").is_file()


def test_the_committed_notebook_holds_its_outputs() -> None:
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(cell.outputs for cell in code)
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]


def collapse_returns(text: str) -> str:
    """A progress bar's stream as a terminal leaves it: each line's last \\r-separated state."""
    return "\n".join(line.rsplit("\r", 1)[-1] for line in re.split(r"\n", text))


def merge_streams(outputs: list) -> list:
    """A cell's outputs with each run of stream outputs to one stream as one, \r collapsed."""
    merged: list = []
    for output in outputs:
        last = merged[-1] if merged else None
        same = last is not None and last.output_type == "stream" == output.output_type
        if same and last.name == output.name:
            last.text += output.text
        else:
            merged.append(output)
    for output in merged:
        if output.output_type == "stream":
            output.text = collapse_returns(output.text)
    return merged


def main() -> None:
    """Run the notebook as it is and write it back with its outputs."""
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    execute(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = merge_streams(cell.outputs)
    nbformat.write(nb, NOTEBOOK)
    print(NOTEBOOK, file=sys.stderr)


if __name__ == "__main__":
    main()
