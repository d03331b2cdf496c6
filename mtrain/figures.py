"""What every mtrain figure shares: matplotlib without a display, and a font with CJK glyphs."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

from matplotlib import font_manager

FONT_FILE = "NotoSansCJKsc-Regular.otf"  # Noto Sans CJK SC: simplified Chinese and Latin


def cjk_font_path() -> Path:
    """The Noto Sans CJK SC font file that the `mplfonts` package ships."""
    import mplfonts

    return Path(mplfonts.__file__).parent / "fonts" / FONT_FILE


def use_cjk_font() -> str:
    """Register Noto Sans CJK SC with matplotlib, make it the default font; return its family.

    The font is added to this process's font manager only: nothing is written into
    matplotlib's configuration or cache directories.
    """
    path = str(cjk_font_path())
    font_manager.fontManager.addfont(path)
    family = font_manager.FontProperties(fname=path).get_name()
    matplotlib.rcParams["font.family"] = family
    return family
