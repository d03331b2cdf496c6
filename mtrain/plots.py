"""The figures of `mtrain plot`: training curves, the positional encoding, the attention masks.

Each function returns a matplotlib Figure; `figures.save` writes it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtrain import jsonl
from mtrain.data import Batch, Example, source_ids
from mtrain.figures import FigureError, use_cjk_font
from mtrain.model import PositionalEncoding, causal_mask, padding_mask
from mtrain.run_dir import METRICS, TRAIN_LOG
from mtrain.tokenizer import PAD_ID

# Curves: (record key, y-axis label, which log holds it).
CURVES = (
    ("loss", "training loss\n(label-smoothed)", "train"),
    ("dev_loss", "dev loss", "validation"),
    ("dev_bleu", "dev BLEU (greedy)", "validation"),
    ("lr", "learning rate", "train"),
)
LOGS = {"train": TRAIN_LOG, "validation": METRICS}


@dataclass
class RunLog:
    """The logged records of one run: training records and validation records, by step."""

    name: str
    train: list[dict] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)
    average: list[dict] = field(default_factory=list)  # the averaged checkpoints' validation


def _by_step(records: list[dict]) -> list[dict]:
    """One record per step, the latest written: a run resumed after a crash logs some twice."""
    return sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])


def read_run(run_dir: Path, name: str) -> RunLog:
    """A run's metrics.jsonl (validations) and train.jsonl (training loss and learning rate)."""
    metrics = jsonl.read(run_dir / METRICS)
    train = jsonl.read(run_dir / TRAIN_LOG)
    if not metrics and not train:
        raise FigureError(
            f"{run_dir}: no {METRICS} or {TRAIN_LOG} (not a run directory, or nothing logged yet)"
        )
    # Validations written before the event key existed have none.
    validation = [r for r in metrics if r.get("event", "validation") == "validation"]
    average = [r for r in metrics if r.get("event") == "average"]
    return RunLog(name, _by_step(train), _by_step(validation), average)


def run_names(run_dirs: list[Path]) -> list[str]:
    """Legend names: each run's folder name, with its parent's where two names clash."""
    paths = [Path(os.path.abspath(p)) for p in run_dirs]  # "." named, symlinks kept as given
    names = [p.name for p in paths]
    return [f"{p.parent.name}/{n}" if names.count(n) > 1 else n for p, n in zip(paths, names)]


def curves(run_dirs: list[Path]):
    """Training loss, dev loss, dev BLEU and learning rate against steps and minutes."""
    use_cjk_font()
    import matplotlib.pyplot as plt

    logs = [read_run(d, n) for d, n in zip(run_dirs, run_names(run_dirs))]
    fig, axes = plt.subplots(len(CURVES), 2, figsize=(11, 12), sharex="col")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, (key, label, source) in enumerate(CURVES):
        for col, x_key in enumerate(("step", "minutes")):
            ax = axes[row, col]
            for i, run in enumerate(logs):
                colour = colours[i % len(colours)]
                records = [r for r in getattr(run, source) if key in r]
                if records:
                    xs, ys = [r[x_key] for r in records], [r[key] for r in records]
                    ax.plot(xs, ys, color=colour, lw=1.2, marker="o" if len(xs) < 40 else None)
                for r in run.average if source == "validation" else []:
                    ax.plot(r[x_key], r[key], "*", color=colour, ms=12, mec="black", mew=0.6)
            if not ax.lines:
                ax.text(
                    0.5,
                    0.5,
                    f"not logged (no {LOGS[source]})",
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                    color="grey",
                )
            ax.set_ylabel(label if col == 0 else "")
            ax.grid(alpha=0.3)
            if key == "lr":
                ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    axes[-1, 0].set_xlabel("step (optimizer updates)")
    axes[-1, 1].set_xlabel("minutes since the start of training")
    handles = [
        plt.Line2D([], [], color=colours[i % len(colours)], lw=2, label=run.name)
        for i, run in enumerate(logs)
    ]
    if any(run.average for run in logs):
        handles.append(
            plt.Line2D(
                [],
                [],
                ls="",
                marker="*",
                ms=12,
                mfc="white",
                mec="black",
                label="averaged checkpoints",
            )
        )
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 3), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.03 * ((len(handles) + 2) // 3 + 0.5)))
    return fig


def positional(d_model: int, max_len: int, dims: tuple[int, ...] = ()):
    """`PositionalEncoding`'s sinusoids as a heatmap and a few dimensions as curves."""
    use_cjk_font()
    import matplotlib.pyplot as plt

    # The model's own module, applied to zeros, returns exactly the signal it adds.
    pe = PositionalEncoding(d_model, max_len)(torch.zeros(1, max_len, d_model))[0]  # (L, d)
    # Even (sin) dimensions, then odd (cos) ones: interleaved, neighbouring columns alternate
    # between ~0 and ~1 and the picture is all stripes.
    order = [*range(0, d_model, 2), *range(1, d_model, 2)]
    fig, (heat, lines) = plt.subplots(1, 2, figsize=(14, 5.2), width_ratios=(1.1, 1))
    image = heat.imshow(
        pe[:, order].numpy(), aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest"
    )
    half = d_model // 2
    heat.axvline(half - 0.5, color="black", lw=1)
    ticks = [0, half // 2, half, half + half // 2, d_model - 1]
    heat.set_xticks(ticks, [str(order[t]) for t in ticks])
    heat.set_xlabel("dimension: even ones (sin) on the left, odd ones (cos) on the right")
    heat.set_ylabel("position in the sentence")
    heat.set_title(f"positions 0–{max_len - 1} × dimensions 0–{d_model - 1}")
    fig.colorbar(image, ax=heat, fraction=0.05)
    # Wavelengths from 2π (dimension 0) to about 10000·2π (the last): a few spread across them.
    dims = dims or tuple(sorted({0, 1, *(d_model // k // 2 * 2 for k in (16, 8, 4, 2))}))
    for dim in dims:
        wave = "sin" if dim % 2 == 0 else "cos"
        lines.plot(pe[:, dim].numpy(), label=f"dimension {dim} ({wave})", lw=1.4)
    lines.set_xlabel("position in the sentence")
    lines.set_ylabel("value added to the embedding")
    lines.set_title("low dimensions oscillate fast, high ones slowly")
    lines.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9)
    lines.grid(alpha=0.3)
    fig.suptitle(
        r"$PE_{(pos,\,2i)} = \sin(pos\,/\,10000^{2i/d_{model}})$,   "
        r"$PE_{(pos,\,2i+1)} = \cos(pos\,/\,10000^{2i/d_{model}})$"
        f"   (d_model = {d_model})",
        fontsize=13,
    )
    fig.tight_layout()
    return fig


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


def masks(inputs: MaskInputs):
    """The source padding mask of a batch, the look-ahead mask and each decoder mask."""
    use_cjk_font()
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    cmap = ListedColormap(["#d9d9d9", "#2b6cb0"])  # False: masked (grey), True: may attend
    batch = inputs.batch
    src_mask = padding_mask(batch.src, PAD_ID)[:, 0, 0, :]  # (B, S), as Transformer.encode
    n = batch.src.size(0)
    if inputs.tgt_in_pieces is None:
        length, tgt_masks = batch.src.size(1), None
    else:
        length = batch.tgt_in.size(1)
        # As Transformer.decode builds it for teacher forcing: (B, 1, T, T).
        tgt_masks = padding_mask(batch.tgt_in, PAD_ID) & causal_mask(length, batch.tgt_in.device)
    lookahead = causal_mask(length, batch.src.device)[0, 0]  # (T, T)

    bottom = ["causal", *(f"dec{i}" for i in range(n))] if tgt_masks is not None else ["causal"]
    fig, axes = plt.subplot_mosaic(
        [["src"] * len(bottom), bottom],
        figsize=(max(4.6 * len(bottom), 7), 3.2 + 4.4),
        height_ratios=(0.5 + 0.4 * n, 4),
    )
    ax = axes["src"]
    ax.imshow(src_mask.numpy(), cmap=cmap, vmin=0, vmax=1, aspect="auto")
    for i, pieces in enumerate(inputs.src_pieces):
        for j in range(batch.src.size(1)):
            text = pieces[j] if j < len(pieces) else "<pad>"
            colour = "white" if src_mask[i, j] else "black"
            ax.text(j, i, text, ha="center", va="center", color=colour, fontsize=11)
    ax.set_yticks(range(n), [f"sentence {i + 1}" for i in range(n)])
    ax.set_xticks(range(batch.src.size(1)), [str(j) for j in range(batch.src.size(1))])
    ax.set_xlabel("source position (key)")
    ax.set_title(
        f"padding_mask(src) of a batch of {n} sentences, {batch.src.size(1)} positions\n"
        "blue: may be attended to (True)   grey: padding, hidden (False)",
        fontsize=10,
    )

    def square(ax, mask: torch.Tensor, labels: list[str], title: str) -> None:
        ax.imshow(mask.numpy(), cmap=cmap, vmin=0, vmax=1)
        ax.set_xticks(range(len(labels)), labels)
        for tick in ax.get_xticklabels():  # words read sideways; a few characters upright
            tick.set_rotation(0 if len(tick.get_text().lstrip("▁")) <= 3 else 90)
        ax.set_yticks(range(len(labels)), labels)
        ax.set_xlabel("key: position attended to")
        ax.set_ylabel("query: position predicting the next piece")
        ax.set_title(title, fontsize=10)

    positions = [f"y{j}" if j else "<s>" for j in range(length)]
    square(axes["causal"], lookahead, positions, f"causal_mask({length}): look-ahead")
    for i in range(n if tgt_masks is not None else 0):
        pieces = inputs.tgt_in_pieces[i]
        labels = pieces + ["<pad>"] * (length - len(pieces))
        square(
            axes[f"dec{i}"],
            tgt_masks[i, 0],
            labels,
            f"sentence {i + 1}: padding & look-ahead\n(the decoder's mask in training)",
        )
    fig.tight_layout()
    return fig
