"""`mtrain plot curves`: training loss, dev loss, dev BLEU and learning rate, from run logs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from mtrain.core import jsonl
from mtrain.figures.common import FigureError, use_cjk_font
from mtrain.run.directory import METRICS, TRAIN_LOG

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


def colours(n: int) -> list:
    """n colours, no two alike: matplotlib's ten (tab10), then the ten lighter ones of tab20,
    then, past twenty, evenly spaced along a rainbow."""
    import matplotlib

    if n <= 20:
        tab20 = matplotlib.colormaps["tab20"].colors
        return list((tab20[0::2] + tab20[1::2])[:n])
    rainbow = matplotlib.colormaps["gist_rainbow"]
    return [rainbow(i / n) for i in range(n)]


def draw_curves(run_dirs: list[Path]):
    """Training loss, dev loss, dev BLEU and learning rate against steps and minutes."""
    use_cjk_font()
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    logs = [read_run(d, n) for d, n in zip(run_dirs, run_names(run_dirs))]
    # A Figure outside pyplot: Jupyter shows it once, where it is returned, and it needs no close
    fig = Figure(figsize=(11, 12))
    axes = fig.subplots(len(CURVES), 2, sharex="col")
    palette = colours(len(logs))
    for row, (key, label, source) in enumerate(CURVES):
        for col, x_key in enumerate(("step", "minutes")):
            ax = axes[row, col]
            for i, run in enumerate(logs):
                colour = palette[i]
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
    handles = [Line2D([], [], color=palette[i], lw=2, label=run.name) for i, run in enumerate(logs)]
    if any(run.average for run in logs):
        handles.append(
            Line2D(
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
