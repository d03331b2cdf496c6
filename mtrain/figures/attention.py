"""The attention maps of `mtrain translate --attention`: a grid of heatmaps per kind of attention,
every layer and head, from the weights `AttentionRecorder` kept."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mtrain.core.errors import OptionError
from mtrain.decoding.attention import AttentionMaps, AttentionRecorder, AxisLabels
from mtrain.decoding.translator import Translator
from mtrain.figures.common import png, use_cjk_font

CELL = 0.32  # inches per heatmap cell
DPI = 100
KINDS = {  # file name: (title, what the rows and columns are)
    "cross": ("Cross-attention", "decoder output (queries) over source pieces (keys and values)"),
    "encoder": ("Encoder self-attention", "source pieces over source pieces"),
    "decoder": ("Decoder masked self-attention", "decoder input over decoder input"),
}
KINDS_IN_MAPS_ORDER = ("encoder", "decoder", "cross")  # AttentionMaps' fields


def figure_size(n_layers: int, n_heads: int, rows: int, cols: int) -> tuple[float, float]:
    """Inches of a grid of n_layers x (n_heads + 1) heatmaps of rows x cols cells."""
    width = (n_heads + 1) * (max(cols, 3) * CELL + 0.3) + 2.0
    height = n_layers * (max(rows, 3) * CELL + 0.5) + 1.6
    return width, height


def save_figures(
    maps: AttentionMaps,
    src_pieces: list[str],
    tgt_in_pieces: list[str],
    tgt_out_pieces: list[str],
    title: str,
    stem: Path,
) -> list[Path]:
    """Write `stem`-cross.png, -encoder.png and -decoder.png: every layer, head and the mean."""
    paths = []
    for kind in KINDS:
        fig = draw_attention(maps, src_pieces, tgt_in_pieces, tgt_out_pieces, title, kind)
        path = stem.with_name(f"{stem.name}-{kind}.png")
        fig.savefig(path)
        paths.append(path)
    return paths


def draw_attention(
    maps: AttentionMaps,
    src_pieces: list[str],
    tgt_in_pieces: list[str],
    tgt_out_pieces: list[str],
    title: str,
    kind: str = "cross",
):
    """One kind of attention ("cross", "encoder" or "decoder"): every layer, head and the mean."""
    from matplotlib.figure import Figure

    use_cjk_font()
    labels = {  # rows, columns
        "cross": (tgt_out_pieces, src_pieces),
        "encoder": (src_pieces, src_pieces),
        "decoder": (tgt_in_pieces, tgt_in_pieces),
    }
    name, axes_text = KINDS[kind]
    layers = getattr(maps, kind)
    rows, cols = labels[kind]
    n_heads = layers[0].size(0)
    fig = Figure(figsize=figure_size(len(layers), n_heads, len(rows), len(cols)), dpi=DPI)
    fig.set_layout_engine("constrained")
    fig.suptitle(f"{name}: {title}\n{axes_text}; grey: exactly 0", fontsize=10)
    grid = fig.subplots(len(layers), n_heads + 1, squeeze=False)
    for layer, weights in enumerate(layers):
        panels = [*weights, weights.mean(dim=0)]  # each head, then their mean
        for head, (ax, w) in enumerate(zip(grid[layer], panels)):
            image = _heatmap(ax, w, rows, cols, head == 0, layer == len(layers) - 1)
            what = f"head {head + 1}" if head < n_heads else "mean of heads"
            ax.set_title(f"layer {layer + 1}, {what}", fontsize=8)
    fig.colorbar(image, ax=grid, shrink=0.8, aspect=30, label="attention weight")
    return fig


@dataclass(repr=False)
class Attention:
    """One translation's attention weights as numpy arrays, one (n_heads, queries, keys) array
    per layer, with the pieces along their axes; shown in a notebook as its cross-attention."""

    source: list[str]  # source pieces: keys of cross-attention, both axes of the encoder's
    decoder_input: list[str]  # <s> y1 ..: both axes of the decoder's self-attention
    output: list[str]  # y1 .. (</s>): queries of cross-attention
    encoder: list[np.ndarray]  # (h, S, S) per layer
    decoder: list[np.ndarray]  # (h, T, T) per layer
    cross: list[np.ndarray]  # (h, T, S) per layer
    title: str

    @classmethod
    def of(cls, maps: AttentionMaps, labels: AxisLabels, title: str) -> Attention:
        arrays = {k: [w.cpu().numpy() for w in getattr(maps, k)] for k in KINDS}
        return cls(labels.source, labels.decoder_input, labels.output, **arrays, title=title)

    @classmethod
    def of_translation(cls, translator: Translator, text: str) -> Attention:
        """The attention weights of `translator`'s translation of `text`."""
        with AttentionRecorder(translator.model) as recorder:
            result = translator.inspect(text, recorder)
        if not result.src:
            raise OptionError("an empty sentence has no attention to show")
        tokens = result.hypotheses[0].tokens
        maps = recorder.maps(tokens)
        labels = maps.axis_labels(result.src, tokens, translator.tokenizer)
        return cls.of(maps, labels, f"{text} → {result.translations[0].text}")

    def figure(self, kind: str = "cross"):
        """A matplotlib Figure of one kind of attention: "cross", "encoder" or "decoder"."""
        maps = AttentionMaps(
            *([torch.from_numpy(w) for w in getattr(self, k)] for k in KINDS_IN_MAPS_ORDER)
        )
        return draw_attention(maps, self.source, self.decoder_input, self.output, self.title, kind)

    def __repr__(self) -> str:
        h = self.cross[0].shape[0]
        return (
            f"<Attention {self.title}: {len(self.cross)} decoder layer(s) x {h} heads, "
            f"{len(self.output)} output pieces over {len(self.source)} source pieces>"
        )

    def _repr_png_(self) -> bytes:
        return png(self.figure("cross"))


def _heatmap(ax, weights: torch.Tensor, rows: list[str], cols: list[str], first, last):
    """One (rows, cols) panel of weights in [0, 1], exact zeros (masked keys) in grey."""
    import matplotlib as mpl
    import numpy as np

    cmap = mpl.colormaps["viridis"].with_extremes(bad="#d0d0d0")
    values = weights.cpu().numpy()
    image = ax.imshow(np.ma.masked_equal(values, 0.0), cmap=cmap, vmin=0.0, vmax=1.0)
    ax.set_xticks(range(len(cols)), cols if last else [], rotation=90, fontsize=8)
    ax.set_yticks(range(len(rows)), rows if first else [], fontsize=8)
    ax.tick_params(length=0)
    return image


def cross_attention_image(
    weights: torch.Tensor, src_pieces: list[str], tgt_pieces: list[str], title: str
):
    """One sentence's (tgt, src) cross-attention as an (H, W, 3) uint8 picture, labelled."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    use_cjk_font()
    rows, cols = len(tgt_pieces), len(src_pieces)
    fig = Figure(figsize=(max(cols, 3) * CELL + 1.6, max(rows, 3) * CELL + 1.4), dpi=DPI)
    fig.set_layout_engine("constrained")
    ax = fig.subplots()
    _heatmap(ax, weights, tgt_pieces, src_pieces, True, True)
    ax.set_title(title, fontsize=8)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()  # (H, W, 3)
