"""The lab's own figures: each variant's difference from the baseline with its interval (a
forest plot), and the cross-attention of a few runs and sentences side by side."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from mtrain.figures.attention import Attention
from mtrain.figures.common import use_cjk_font
from mtrain.figures.curves import colours


@dataclass
class Difference:
    """One seed of a variant against the baseline of that seed."""

    seed: int
    delta: float  # BLEU minus the baseline's
    low: float  # the 95% interval of `delta`
    high: float
    significant: bool


@dataclass
class VariantDifferences:
    """A variant's differences seed by seed; `note` where it has none (it diverged...)."""

    variant: str
    seeds: list[Difference]
    note: str = ""


def draw_differences(variants: list[VariantDifferences], seed_sd: float | None = None):
    """A row per variant: each seed's difference with its interval (filled where significant),
    the mean ± sd over seeds (with two or more), the zero line and, given the baseline's
    standard deviation over seeds, the band of seed noise (± twice it)."""
    use_cjk_font()
    from matplotlib.figure import Figure

    seeds = sorted({d.seed for v in variants for d in v.seeds})
    palette = dict(zip(seeds, colours(len(seeds))))
    # Each seed a little above or below its variant's line, the mean on it.
    offset = {s: 0.3 * (i / max(len(seeds) - 1, 1) - 0.5) for i, s in enumerate(seeds)}
    fig = Figure(figsize=(9, 1.9 + 0.6 * len(variants)))
    ax, key = fig.subplots(2, 1, height_ratios=(0.8 + 0.6 * len(variants), 0.7))
    if seed_sd is not None:
        ax.axvspan(-2 * seed_sd, 2 * seed_sd, color="#e4e4e4", zorder=0)
    ax.axvline(0, color="black", lw=0.8, zorder=1)
    for y, variant in enumerate(variants):
        for d in variant.seeds:
            colour, at = palette[d.seed], y + offset[d.seed] * (len(seeds) > 1)
            ax.plot([d.low, d.high], [at, at], color=colour, lw=1.5)
            fill = colour if d.significant else "white"
            ax.plot(d.delta, at, "o", color=colour, mfc=fill, ms=6, zorder=3)
        if len(variant.seeds) >= 2:
            deltas = [d.delta for d in variant.seeds]
            mean, sd = statistics.mean(deltas), statistics.stdev(deltas)
            ax.errorbar(mean, y, xerr=sd, fmt="D", color="black", ms=6, capsize=4, zorder=4)
        if variant.note:
            ax.text(0, y, f"  {variant.note}", va="center", ha="left", color="grey", fontsize=9)
    ax.set_yticks(range(len(variants)), [v.variant for v in variants])
    ax.set_ylim(len(variants) - 0.5, -0.5)  # the first variant at the top
    ax.set_xlabel("test BLEU minus the baseline's (same seed)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title("Each variant against the baseline", fontsize=11)
    key.axis("off")
    key.legend(handles=legend(palette, seed_sd), loc="center", ncol=3, frameon=False, fontsize=8)
    fig.set_layout_engine("constrained")
    return fig


def legend(palette: dict, seed_sd: float | None) -> list:
    """The key of `draw_differences`: what each mark and the band mean."""
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color=c, marker="o", lw=1.5, label=f"seed {s}: difference, 95% interval")
        for s, c in palette.items()
    ]
    handles.append(
        Line2D([], [], color="grey", marker="o", mfc="white", ls="", label="not significant")
    )
    if len(palette) >= 2:
        handles.append(
            Line2D([], [], color="black", marker="D", ls="", label="mean ± sd over seeds")
        )
    if seed_sd is not None:
        band = f"seed noise: ± 2 × the baseline's sd ({seed_sd:.2f})"
        handles.append(Line2D([], [], color="#e4e4e4", lw=8, label=band))
    return handles


def draw_cross_attention(runs: dict[str, list[Attention]]):
    """A row per run (named), a column per sentence: the cross-attention of its last decoder
    layer, the mean of its heads, with the translation in the panel's title."""
    use_cjk_font()
    import matplotlib as mpl
    import numpy as np
    from matplotlib.figure import Figure

    columns = max(len(a) for a in runs.values())
    fig = Figure(figsize=(4.2 * columns + 1.2, 3.6 * len(runs)))
    grid = fig.subplots(len(runs), columns, squeeze=False)
    cmap = mpl.colormaps["viridis"]
    image = None
    for row, (name, attentions) in enumerate(runs.items()):
        for col, attention in enumerate(attentions):
            ax = grid[row, col]
            weights = attention.cross[-1].mean(axis=0)  # (output pieces, source pieces)
            image = ax.imshow(np.asarray(weights), cmap=cmap, vmin=0, vmax=1, aspect="auto")
            ax.set_xticks(range(len(attention.source)), attention.source, fontsize=9)
            ax.set_yticks(range(len(attention.output)), attention.output, fontsize=9)
            ax.tick_params(length=0)
            ax.set_title(f"{name}:\n{attention.title}", fontsize=9)
    fig.set_layout_engine("constrained")
    fig.colorbar(image, ax=grid, shrink=0.8, aspect=30, label="attention weight")
    return fig
