"""Figures, a module for each: `curves`, `positional` and `masks` (`mtrain plot`), and
`attention` (`mtrain translate --attention`) and `trace` (`--trace` as a figure), whose
`Attention` and `Trace` also show in Jupyter; `common` holds what they share: the CJK font, the
output formats, `save` and `png`.

Each `draw_*` function returns a matplotlib Figure, which `common.save` writes. matplotlib is
imported only when a figure is drawn: importing these modules does not load it.

Stage 5: it imports only from the stages before it (`core`, `data`, `model`, `run`,
`decoding`); training draws attention maps for TensorBoard with it.
"""
