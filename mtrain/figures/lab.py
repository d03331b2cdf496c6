"""The lab's own figures: each variant's difference from the baseline with its interval (a
forest plot), and the cross-attention of a few runs and sentences side by side."""

from __future__ import annotations

from dataclasses import dataclass

from mtrain.core.significance import MeanDifference
from mtrain.figures.attention import Attention
from mtrain.figures.common import use_cjk_font
from mtrain.figures.curves import colours

BAND = "#e4e4e4"  # the band a mean over seeds must leave to be beyond noise


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
    """A variant's differences seed by seed; `note` where it has none (it diverged...); `mean`
    over them with the interval its verdict reads, where two or more seeds were compared."""

    variant: str
    seeds: list[Difference]
    note: str = ""
    mean: MeanDifference | None = None


def draw_differences(variants: list[VariantDifferences]):
    """A row per variant: each seed's difference with its interval (filled where significant),
    the zero line and, where it has a mean over seeds, that mean with its interval (filled
    where the interval leaves out 0) over a grey band of ± the interval's half-width around 0:
    the mean is beyond noise exactly where it lies outside its band."""
    use_cjk_font()
    from matplotlib.figure import Figure

    seeds = sorted({d.seed for v in variants for d in v.seeds})
    palette = dict(zip(seeds, colours(len(seeds))))
    # Each seed a little above its variant's line, its mean below: on the line where one seed.
    offset = {s: 0.3 * (i / max(len(seeds) - 1, 1) - 0.5) - 0.1 for i, s in enumerate(seeds)}
    means = any(v.mean is not None for v in variants)
    handles = legend(palette, means)
    key_rows = -(-len(handles) // 2)  # two entries a row: three would be wider than the figure
    fig = Figure(figsize=(9, 1.5 + 0.6 * len(variants) + 0.25 * key_rows))
    ax, key = fig.subplots(2, 1, height_ratios=(0.8 + 0.6 * len(variants), 0.25 * key_rows + 0.2))
    ax.axvline(0, color="black", lw=0.8, zorder=1)
    for y, variant in enumerate(variants):
        if variant.mean is not None:
            m = variant.mean
            half = m.half_width
            ax.barh(y, 2 * half, left=-half, height=0.8, color=BAND, zorder=0)
            fill = "black" if m.beyond_noise else "white"
            whiskers = [[m.mean - m.low], [m.high - m.mean]]
            ax.errorbar(m.mean, y + 0.2, xerr=whiskers, fmt="D", color="black", mfc=fill, ms=6,
                        capsize=4, zorder=4)  # fmt: skip
        for d in variant.seeds:
            colour, at = palette[d.seed], y + offset[d.seed] * (len(seeds) > 1)
            ax.plot([d.low, d.high], [at, at], color=colour, lw=1.5)
            fill = colour if d.significant else "white"
            ax.plot(d.delta, at, "o", color=colour, mfc=fill, ms=6, zorder=3)
        if variant.note:
            ax.text(0, y, f"  {variant.note}", va="center", ha="left", color="grey", fontsize=9)
    ax.set_yticks(range(len(variants)), [v.variant for v in variants])
    ax.set_ylim(len(variants) - 0.5, -0.5)  # the first variant at the top
    ax.set_xlabel("test BLEU minus the baseline's (same seed)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title("Each variant against the baseline", fontsize=11)
    key.axis("off")
    key.legend(handles=handles, loc="center", ncol=2, frameon=False, fontsize=8)
    fig.set_layout_engine("constrained")
    return fig


def legend(palette: dict, means: bool) -> list:
    """The key of `draw_differences`: what each mark and the band mean."""
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color=c, marker="o", lw=1.5, label=f"seed {s}: difference, 95% interval")
        for s, c in palette.items()
    ]
    handles.append(
        Line2D([], [], color="grey", marker="o", mfc="white", ls="", label="not significant")
    )
    if means:
        mean = "mean over seeds, its 95% interval (hollow: within noise)"
        handles.append(Line2D([], [], color="black", marker="D", lw=1.5, label=mean))
        band = "the verdict's threshold, ± the half-width: beyond noise outside it"
        handles.append(Line2D([], [], color=BAND, lw=8, label=band))
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
