"""What every figure shares: the Agg backend, a font with Chinese glyphs, output formats, saving."""

from __future__ import annotations

import importlib.util
import io
import os
from functools import lru_cache
from pathlib import Path

from mtrain.core.errors import MtrainError
from mtrain.core.files import FileRefused, open_output, output_kind

CJK_FONT = "NotoSansCJKsc-Regular.otf"  # Noto Sans CJK SC, shipped by the mplfonts package


class FigureError(MtrainError, RuntimeError):
    """A figure that cannot be drawn (no font, nothing to plot); the message says why."""


def cjk_font_path() -> Path:
    """The Noto Sans CJK SC file inside the installed mplfonts package."""
    # find_spec locates the package without importing it (its import pulls in extra modules).
    spec = importlib.util.find_spec("mplfonts")
    path = None if spec is None or spec.origin is None else Path(spec.origin).parent / "fonts"
    if path is None or not (path / CJK_FONT).is_file():
        raise FigureError("no CJK font: install the mplfonts package (pip install mplfonts)")
    return path / CJK_FONT


@lru_cache(maxsize=1)
def use_cjk_font() -> str:
    """Select Agg (but in Jupyter) and Noto Sans CJK SC as the font; return its family name."""
    import matplotlib

    if "inline" not in os.environ.get("MPLBACKEND", ""):  # Jupyter's shows figures in the page
        matplotlib.use("Agg")  # files only: no display needed
    from matplotlib import font_manager

    path = cjk_font_path()
    font_manager.fontManager.addfont(str(path))  # this process only; no config dir is written
    family = font_manager.FontProperties(fname=str(path)).get_name()
    matplotlib.rcParams["font.family"] = family
    return family


def formats() -> list[str]:
    """The file suffixes `save` can write: matplotlib's, but for PGF, which needs LaTeX."""
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(set(FigureCanvasBase.get_supported_filetypes()) - {"pgf"})


def check_output(path: Path) -> Path:
    """Refuse a figure path whose suffix names no format `save` can write, or that is not a
    file, a device or a pipe (a directory, a socket); before drawing."""
    try:
        output_kind(path)
    except FileRefused as e:
        raise FigureError(str(e)) from None
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in formats():
        what = f"a .{suffix} file" if suffix else "a file without a suffix"
        raise FigureError(
            f"{path}: cannot draw a figure into {what}; use .png, or any of "
            + ", ".join(f".{f}" for f in formats())
        )
    return path


def save(fig, path: Path, dpi: int = 120) -> Path:
    """Write a figure (creating the folder), in the format its suffix names; free it. A file
    is replaced atomically, a device or FIFO written in place (`files.open_output`)."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open_output(path) as f:
            fig.savefig(f, format=path.suffix.lower().lstrip("."), dpi=dpi)
    finally:
        plt.close(fig)
    return path


def png(fig, dpi: int = 100) -> bytes:
    """A figure as PNG bytes: what a notebook shows of a result that is a picture."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()
