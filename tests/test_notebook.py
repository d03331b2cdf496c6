"""docs/notebook.ipynb, run from top to bottom as it is committed, gives the outputs committed
with it: line by line, once what depends on the machine is set aside (times, speeds, paths,
the progress lines a slower machine writes more of) and its numbers are compared within a
tolerance (another CPU rounds its sums in another order).

It runs as a user runs it, from a directory that holds the repository's configs/ and data/
(a fresh one: the run starts afresh each time) and, in the test, the repository's prepared/,
where the tests' tiny run prepares the same corpus: the lines of preparing it, which only a
first run writes, are set aside too. `python -m tests.test_notebook` runs it from a directory
of its own (the corpus prepared afresh, as a new user sees it) and writes it back with its
outputs, the paths of that directory shown relative to it.
"""

from __future__ import annotations

import math
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest

from .console import REPO

NOTEBOOK = REPO / "docs" / "notebook.ipynb"
TOLERANCE = 0.05  # relative and absolute, on each number of the outputs


def execute(nb, root: Path, timeout: int = 600, cached: bool = True) -> None:
    """Run every cell of `nb` in a fresh kernel, from `root`, on this checkout, on the CPU;
    `cached`: with the repository's prepared corpora."""
    from nbclient import NotebookClient

    for name in ("configs", "data", "prepared") if cached else ("configs", "data"):
        (root / name).symlink_to(REPO / name, target_is_directory=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])
    )
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the numbers of a CPU, which the committed are
    NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(root)}}
    ).execute()


# What depends on the machine: clock times and durations, speeds, minutes into the run, and
# the directory the notebook ran from (which the prepared corpus's key hashes too).
MACHINE = [
    (re.compile(r"(?:/[^\s/'\"]+)+/(?=(?:prepared|data|runs|configs)/)"), ""),
    (re.compile(r"\b(prepared/\S+-)[0-9a-f]{12}\b"), r"\1KEY"),
    (re.compile(r"\[[\d:]+(?:<[\d:?]+)?, [^\]]*\]"), "[TIME]"),  # a bar's [elapsed<left, rate]
    (re.compile(r"\b\d+(?:\.\d+)? ?min\b"), "M min"),
    (re.compile(r"\btok_s \d+"), "tok_s N"),
    (re.compile(r"\b(left) [\d:]+"), r"\1 T"),
]
PATHS = MACHINE[0]
PREPARING = re.compile(r"^(?:sample|prepare): |^prepared \S+ in ")  # a first run's lines only
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
BAR = re.compile(r"^(\w+): +\d+%\|")  # a bar's line off a terminal: its desc first
PROGRESS = re.compile(r"^step \d+/\S+  ")  # training's plain progress line


def progress_kept(lines: list[str]) -> list[str]:
    """The lines a slower machine writes no more of: each bar's first and last line, the first
    of training's progress lines (the others come every minute as well as every 100 steps)."""
    last_of = {}
    for i, line in enumerate(lines):
        if m := BAR.match(line):
            last_of[m.group(1)] = i
    kept, seen, progress_seen = [], set(), False
    for i, line in enumerate(lines):
        if m := BAR.match(line):
            if m.group(1) in seen and last_of[m.group(1)] != i:
                continue
            seen.add(m.group(1))
        elif PROGRESS.match(line):
            if progress_seen:
                continue
            progress_seen = True
        kept.append(line)
    return kept


def normalised(text: str) -> list[tuple[str, list[float]]]:
    """Each line as its text with the machine's parts set aside and its numbers taken out."""
    lines = progress_kept([line for line in text.splitlines() if not PREPARING.match(line)])
    out = []
    for line in lines:
        for pattern, replacement in MACHINE:
            line = pattern.sub(replacement, line)
        numbers = [float(n) for n in NUMBER.findall(line)]
        out.append((NUMBER.sub("#", line), numbers))
    return out


def shown(cell) -> list[str]:
    """A cell's outputs as text: streams by name, results and displays by their kinds."""
    texts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            texts.append(f"[{output.name}]\n{output.text}")
        elif output.output_type in ("execute_result", "display_data"):
            data = output.get("data", {})
            kinds = ",".join(sorted(data))
            texts.append(f"[{output.output_type} {kinds}]\n{data.get('text/plain', '')}")
        else:
            texts.append(f"[{output.output_type}] {output.get('ename')}: {output.get('evalue')}")
    return texts


def differences(committed, ran) -> list[str]:
    """Where the cells' outputs differ, line by line, beyond the machine's part."""
    found = []
    for number, (old, new) in enumerate(zip(committed.cells, ran.cells)):
        if old.cell_type != "code":
            continue
        want = normalised("\n".join(shown(old)))
        got = normalised("\n".join(shown(new)))
        if len(want) != len(got):
            found.append(f"cell {number}: {len(got)} lines, committed {len(want)}")
        for (text, values), (got_text, got_values) in zip(want, got):
            close = len(values) == len(got_values) and all(
                math.isclose(a, b, rel_tol=TOLERANCE, abs_tol=TOLERANCE)
                for a, b in zip(values, got_values)
            )
            if text != got_text or not close:
                found.append(f"cell {number}: {got_text} {got_values} != {text} {values}")
    return found


def merge_streams(outputs: list) -> list:
    """A cell's outputs with each run of stream outputs to one stream as one."""
    merged: list = []
    for output in outputs:
        last = merged[-1] if merged else None
        same = last is not None and last.output_type == "stream" == output.output_type
        if same and last.name == output.name:
            last.text += output.text
        else:
            merged.append(output)
    return merged


def run(nb, timeout: int = 600, cached: bool = True) -> None:
    """Execute `nb` from a fresh directory, each cell's streams merged as Jupyter shows them."""
    Path(REPO / "prepared").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as root:
        execute(nb, Path(root), timeout, cached)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = merge_streams(cell.outputs)


def test_the_notebook_gives_its_committed_outputs() -> None:
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    committed = nbformat.read(NOTEBOOK, as_version=4)
    ran = nbformat.read(NOTEBOOK, as_version=4)
    run(ran)
    assert not [o for c in ran.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert differences(committed, ran) == []


def test_the_committed_notebook_shows_plain_progress_and_no_frames() -> None:
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(cell.outputs for cell in code)
    text = "\n".join(line for cell in code for line in shown(cell))
    assert "\r" not in text and "[error]" not in text
    assert sum("image/png" in line for line in text.splitlines()) == 3  # attention, trace, curves
    lines = text.splitlines()
    assert any(PROGRESS.match(line) for line in lines)  # training's plain progress line
    assert any(line.startswith("finished at step ") for line in lines)


def test_the_comparison_sees_a_changed_word_and_a_far_number() -> None:
    """The comparison above can fail: on a word, on a number beyond the tolerance, on a line
    more; and it passes times, speeds, paths and a number within the tolerance."""
    nbformat = pytest.importorskip("nbformat")

    def notebook(text: str):
        cell = nbformat.v4.new_code_cell("x")
        cell.outputs = [nbformat.v4.new_output("stream", name="stderr", text=text)]
        return nbformat.v4.new_notebook(cells=[cell])

    base = notebook("step 30  0.5 min  dev loss 7.012  dev BLEU 0.10\n  我 → I.\n")
    same = notebook("step 30  1.5 min  dev loss 7.020  dev BLEU 0.10\n  我 → I.\n")
    assert differences(base, same) == []
    for other in (
        "step 30  0.5 min  dev loss 7.012  dev BLEU 0.10\n  我 → You.\n",
        "step 30  0.5 min  dev loss 9.012  dev BLEU 0.10\n  我 → I.\n",
        "step 30  0.5 min  dev loss 7.012  dev BLEU 0.10\n  我 → I.\nmore\n",
    ):
        assert differences(base, notebook(other)) != []
    path = "/tmp/x/prepared/train-1 [00:03<00:00, 1.2MB/s]"
    assert normalised(path) == normalised("/work/y/prepared/train-1 [01:10<00:00, 3.4kB/s]")


def relative_paths(nb) -> None:
    """The streams' paths under the directory the notebook ran from, relative to it."""
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.output_type == "stream":
                output.text = PATHS[0].sub("", output.text)


def main() -> None:
    """Run the notebook as it is and write it back with its outputs."""
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    run(nb, timeout=3600, cached=False)
    relative_paths(nb)
    nbformat.write(nb, NOTEBOOK)
    print(NOTEBOOK, file=sys.stderr)


if __name__ == "__main__":
    main()
