"""Attention weights of a translation (`--attention`), gathered while the search runs.

`AttentionRecorder` turns on the model's weight keeping and observes the search: after each
step it reads the weights the decoder has just used and appends them to the history of every
live hypothesis, so the maps of the output come from the very pass that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mtrain.decode import BeamStep, GreedyStep
from mtrain.model import Transformer
from mtrain.tokenizer import EOS_ID


@dataclass
class AttentionMaps:
    """One sentence's attention weights, one (n_heads, queries, keys) tensor per layer."""

    encoder: list[torch.Tensor]  # (h, S, S): source pieces over source pieces
    decoder: list[torch.Tensor]  # (h, T, T): decoder inputs over decoder inputs (look-ahead)
    cross: list[torch.Tensor]  # (h, T, S): output pieces over source pieces


def _grow(history: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Append one query row (b, h, 1, t) to a history (b, h, t - 1, t - 1): (b, h, t, t).

    The keys of positions not decoded yet never existed; their weights are exactly 0.
    """
    return torch.cat([F.pad(history, (0, rows.size(-1) - history.size(-1))), rows], dim=2)


class AttentionRecorder:
    """An observer for `greedy` / `beam_search` over one sentence; a context manager around it."""

    def __init__(self, model: Transformer):
        self.model = model
        self.encoder: list[torch.Tensor] = []  # (h, S, S) per layer
        self.cross: list[torch.Tensor] = []  # (rows, h, t, S) per layer: each live hypothesis'
        self.decoder: list[torch.Tensor] = []  # (rows, h, t, t) per layer
        self.finished: dict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def __enter__(self) -> AttentionRecorder:
        self.model.record_attention(True)
        return self

    def __exit__(self, *exc) -> None:
        self.model.record_attention(False)

    def __call__(self, event: GreedyStep | BeamStep) -> None:
        weights = self.model.attention_weights()
        # The newest position's query row: all the decoder computed, when it uses its cache.
        newest = {
            kind: [w[:, :, -1:].float() for w in weights[kind]] for kind in ("cross", "decoder")
        }
        if not self.encoder:  # the first step: the encoder ran once, just before it
            if weights["encoder"][0].size(0) != 1:
                raise ValueError("AttentionRecorder follows a search over one sentence")
            self.encoder = [w[0].float() for w in weights["encoder"]]
            self.cross, self.decoder = newest["cross"], newest["decoder"]
        else:
            self.cross = [torch.cat([h, w], dim=2) for h, w in zip(self.cross, newest["cross"])]
            self.decoder = [_grow(h, w) for h, w in zip(self.decoder, newest["decoder"])]
        if isinstance(event, BeamStep):
            self._beam(event)

    def _beam(self, event: BeamStep) -> None:
        for c in event.candidates[0]:
            if c.fate == "finished":
                body = event.tokens[c.origin, 1:].tolist()
                self.finished[(*body, c.token)] = (
                    [h[c.origin] for h in self.cross],
                    [h[c.origin] for h in self.decoder],
                )
        if event.select is not None:  # the next step's hypotheses continue these rows
            self.cross = [h[event.select] for h in self.cross]
            self.decoder = [h[event.select] for h in self.decoder]

    def maps(self, tokens: list[int]) -> AttentionMaps:
        """The maps of an output of the search: a hypothesis' tokens, without </s>."""
        if self.finished:  # beam search: the finished hypothesis with these tokens
            ended = self.finished.get((*tokens, EOS_ID))
            cross, decoder = ended or self.finished[tuple(tokens)]
        else:  # greedy search: the one row there is
            cross, decoder = [h[0] for h in self.cross], [h[0] for h in self.decoder]
        return AttentionMaps(self.encoder, decoder, cross)


CELL = 0.32  # inches per heatmap cell
DPI = 100
KINDS = {  # file name: (title, what the rows and columns are)
    "cross": ("Cross-attention", "decoder output (queries) over source pieces (keys and values)"),
    "encoder": ("Encoder self-attention", "source pieces over source pieces"),
    "decoder": ("Decoder masked self-attention", "decoder input over decoder input"),
}


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
    from matplotlib.figure import Figure

    from mtrain.figures import use_cjk_font

    use_cjk_font()
    labels = {  # rows, columns
        "cross": (tgt_out_pieces, src_pieces),
        "encoder": (src_pieces, src_pieces),
        "decoder": (tgt_in_pieces, tgt_in_pieces),
    }
    paths = []
    for kind, (name, axes_text) in KINDS.items():
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
        path = stem.with_name(f"{stem.name}-{kind}.png")
        fig.savefig(path)
        paths.append(path)
    return paths


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
