"""The trace of one translation (`mtrain translate --trace`) as plain data, as text, and as a
figure: each step's likeliest next pieces (greedy) or ranked candidates (beam search)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mtrain.data.tokenizer import Tokenizer
from mtrain.decoding.trace import TraceStep, format_trace
from mtrain.figures.common import png, use_cjk_font

COLUMNS = 4  # panels per row of the figure
COLOURS = {"chosen": "#d62728", "alive": "#1f77b4", "finished": "#2ca02c", "pruned": "#c7c7c7"}


def step_record(step: TraceStep, tokenizer: Tokenizer) -> dict[str, Any]:
    """One step of a trace as plain values, pieces as text."""
    pieces = tokenizer.tgt.id_to_piece
    if step.chosen is not None:  # greedy
        return {
            "step": step.step,
            "input": pieces(step.inputs[0]),
            "log_prob_so_far": step.log_probs[0],
            "top": [(pieces(t), p) for t, p in step.top],  # probabilities
            "chosen": pieces(step.chosen),
            "chosen_log_prob": step.chosen_log_prob,
        }
    return {
        "step": step.step,
        "hypotheses": [(pieces(t), lp) for t, lp in zip(step.inputs, step.log_probs)],
        "candidates": [
            {
                "origin": c.origin,
                "piece": pieces(c.token),
                "log_prob": c.log_prob - step.log_probs[c.origin],  # the piece's own
                "cumulative": c.log_prob,
                "fate": c.fate,
                "score": c.score,
            }
            for c in step.candidates
        ],
    }


@dataclass(repr=False)
class Trace:
    """How one sentence was decoded, step by step; prints as `--trace` does, shows as a figure."""

    source: str
    source_pieces: list[str]
    source_ids: list[int]
    steps: list[dict[str, Any]]  # `step_record`s
    translation: str
    score: float | None  # beam search's; None from greedy search
    text: str  # as `mtrain translate --trace` prints it

    @classmethod
    def of(
        cls,
        text: str,
        src_ids: list[int],
        steps: list[TraceStep],
        tokenizer: Tokenizer,
        translation: str,
        score: float | None,
    ) -> Trace:
        shown = format_trace(src_ids, steps, tokenizer, text)
        tail = "" if score is None else f"   (score {score:.4f})"
        return cls(
            text,
            tokenizer.src.id_to_piece(src_ids),
            src_ids,
            [step_record(s, tokenizer) for s in steps],
            translation,
            score,
            f"{shown}\ntranslation: {translation}{tail}",
        )

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"<Trace {self.source} → {self.translation}: {len(self.steps)} steps>"

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(self.text)

    def figure(self):
        """A matplotlib Figure: one panel per step, the probability of each piece considered."""
        from matplotlib.figure import Figure

        use_cjk_font()
        n = max(len(self.steps), 1)
        rows = math.ceil(n / COLUMNS)
        fig = Figure(figsize=(3.2 * min(n, COLUMNS), 2.4 * rows), dpi=100)
        fig.set_layout_engine("constrained")
        fig.suptitle(f"{self.source} → {self.translation}", fontsize=10)
        axes = fig.subplots(rows, min(n, COLUMNS), squeeze=False).ravel()
        for ax, step in zip(axes, self.steps):
            if "top" in step:
                labels = [p for p, _ in step["top"]]
                values = [p for _, p in step["top"]]
                colours = [COLOURS["chosen" if p == step["chosen"] else "pruned"] for p in labels]
            else:
                labels = [f"[{c['origin']}] {c['piece']}" for c in step["candidates"]]
                values = [math.exp(c["log_prob"]) for c in step["candidates"]]
                colours = [COLOURS[c["fate"]] for c in step["candidates"]]
            ax.barh(range(len(labels)), values, color=colours)
            ax.set_yticks(range(len(labels)), labels, fontsize=8)
            ax.invert_yaxis()
            ax.set_xlim(0, 1)
            ax.set_title(f"step {step['step']}", fontsize=9)
            ax.tick_params(axis="x", labelsize=7)
        for ax in axes[len(self.steps) :]:
            ax.set_axis_off()
        return fig

    def _repr_png_(self) -> bytes:
        return png(self.figure())
