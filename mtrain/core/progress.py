"""The progress bar: tqdm's notebook widget under Jupyter (where ipywidgets is installed), its
text bar on stderr everywhere else."""

from __future__ import annotations

import warnings

from tqdm.std import TqdmWarning

with warnings.catch_warnings():
    warnings.simplefilter("ignore", TqdmWarning)  # Jupyter without ipywidgets: the text bar
    from tqdm.auto import tqdm

__all__ = ["tqdm"]


def is_widget() -> bool:
    """Whether the bar is Jupyter's widget (drawn in place, never as lines on stderr)."""
    from tqdm import notebook

    return issubclass(tqdm, notebook.tqdm)
