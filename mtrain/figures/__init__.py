"""Figures, a module for each: `curves`, `positional` and `masks` (`mtrain plot`), and
`attention` (`mtrain translate --attention`); `common` holds what they share: the CJK font,
the output formats and `save`.

Each `draw_*` function returns a matplotlib Figure, which `common.save` writes. matplotlib is
imported only when a figure is drawn: importing these modules does not load it.
"""
