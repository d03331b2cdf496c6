"""`mtrain plot positional`: the sinusoidal positional encoding, from the model's own module."""

from __future__ import annotations

import torch

from mtrain.figures.common import use_cjk_font
from mtrain.model.transformer import PositionalEncoding


def draw_positional(d_model: int, max_len: int, dims: tuple[int, ...] = ()):
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
