"""`mtrain plot masks`: the masks of a batch, from the functions the model builds them with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtrain.data.pairs import Batch, Example, source_ids
from mtrain.data.tokenizer import PAD_ID
from mtrain.figures.common import use_cjk_font
from mtrain.model.transformer import causal_mask, padding_mask, teacher_forcing_mask


@dataclass
class MaskInputs:
    """A batch to draw masks of: ids, and the piece shown for each id position."""

    batch: Batch
    src_pieces: list[list[str]]  # per sentence, without padding
    tgt_in_pieces: list[list[str]] | None  # per sentence, <s> first; None: no target known


def mask_inputs(
    src_ids: list[list[int]],
    src_pieces: list[list[str]],
    tgt_ids: list[list[int]] | None,
    tgt_pieces: list[list[str]] | None,
    max_src_len: int,
) -> MaskInputs:
    """Build the training code's Batch from pieces (ids and their printable pieces)."""
    srcs = [source_ids(ids, max_src_len) for ids in src_ids]
    src_labels = [[*p[: len(s) - 1], "</s>"] for p, s in zip(src_pieces, srcs)]
    if tgt_ids is None:
        batch = Batch.collate([Example(s, []) for s in srcs])  # no target: only src is drawn
        return MaskInputs(batch, src_labels, None)
    batch = Batch.collate([Example(s, t) for s, t in zip(srcs, tgt_ids)])
    return MaskInputs(batch, src_labels, [["<s>", *p] for p in tgt_pieces])


def draw_masks(inputs: MaskInputs):
    """The source padding mask of a batch, the look-ahead mask and each decoder mask."""
    use_cjk_font()
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    cmap = ListedColormap(["#d9d9d9", "#2b6cb0"])  # False: masked (grey), True: may attend
    batch = inputs.batch
    n = batch.src.size(0)
    if inputs.tgt_in_pieces is None:
        length, tgt_masks = batch.src.size(1), None
    else:
        length = batch.tgt_in.size(1)
        tgt_masks = teacher_forcing_mask(batch.tgt_in, PAD_ID)  # (B, 1, T, T), as in training
    bottom = ["causal", *(f"dec{i}" for i in range(n))] if tgt_masks is not None else ["causal"]
    fig, axes = plt.subplot_mosaic(
        [["src"] * len(bottom), bottom],
        figsize=(max(4.6 * len(bottom), 7), 3.2 + 4.4),
        height_ratios=(0.5 + 0.4 * n, 4),
    )
    _source_panel(axes["src"], inputs, cmap)
    lookahead = causal_mask(length, batch.src.device)[0, 0]  # (T, T)
    positions = [f"y{j}" if j else "<s>" for j in range(length)]
    _square(axes["causal"], lookahead, positions, f"causal_mask({length}): look-ahead", cmap)
    for i in range(n if tgt_masks is not None else 0):
        pieces = inputs.tgt_in_pieces[i]
        labels = pieces + ["<pad>"] * (length - len(pieces))
        title = f"sentence {i + 1}: padding & look-ahead\n(the decoder's mask in training)"
        _square(axes[f"dec{i}"], tgt_masks[i, 0], labels, title, cmap)
    fig.tight_layout()
    return fig


def _source_panel(ax, inputs: MaskInputs, cmap) -> None:
    """The source padding mask, as `Transformer.encode` builds it, with each piece written in."""
    src = inputs.batch.src  # (B, S)
    src_mask = padding_mask(src, PAD_ID)[:, 0, 0, :]  # (B, 1, 1, S) -> (B, S)
    n, width = src.shape
    ax.imshow(src_mask.numpy(), cmap=cmap, vmin=0, vmax=1, aspect="auto")
    for i, pieces in enumerate(inputs.src_pieces):
        for j in range(width):
            text = pieces[j] if j < len(pieces) else "<pad>"
            colour = "white" if src_mask[i, j] else "black"
            ax.text(j, i, text, ha="center", va="center", color=colour, fontsize=11)
    ax.set_yticks(range(n), [f"sentence {i + 1}" for i in range(n)])
    ax.set_xticks(range(width), [str(j) for j in range(width)])
    ax.set_xlabel("source position (key)")
    ax.set_title(
        f"padding_mask(src) of a batch of {n} sentences, {width} positions\n"
        "blue: may be attended to (True)   grey: padding, hidden (False)",
        fontsize=10,
    )


def _square(ax, mask: torch.Tensor, labels: list[str], title: str, cmap) -> None:
    """A (T, T) mask of queries over keys, both axes labelled with the decoder's pieces."""
    ax.imshow(mask.numpy(), cmap=cmap, vmin=0, vmax=1)
    ax.set_xticks(range(len(labels)), labels)
    for tick in ax.get_xticklabels():  # words read sideways; a few characters upright
        tick.set_rotation(0 if len(tick.get_text().lstrip("▁")) <= 3 else 90)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("key: position attended to")
    ax.set_ylabel("query: position predicting the next piece")
    ax.set_title(title, fontsize=10)
