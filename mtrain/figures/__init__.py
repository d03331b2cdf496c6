"""Figures, a module for each: `curves`, `positional` and `masks` (`mtrain plot`), and
`attention` (`mtrain translate --attention`); `common` holds what they share: the CJK font,
the output formats and `save`.

Each `draw_*` function returns a matplotlib Figure, which `common.save` writes. matplotlib is
imported only when a figure is drawn: importing these modules does not load it.

Stage 5: it imports only from the stages before it (`core`, `data`, `model`, `run`,
`decoding`); training draws attention maps for TensorBoard with it.
"""
