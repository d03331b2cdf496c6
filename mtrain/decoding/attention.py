"""Attention weights of a translation (`--attention`), gathered while the search runs.

`AttentionRecorder` turns on the model's weight keeping and observes the search: after each
step it reads the weights the decoder has just used and appends them to the history of every
live hypothesis, so the maps of the output come from the very pass that produced it.
`mtrain.figures.attention` draws them; recording needs no matplotlib.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mtrain.data.tokenizer import BOS_ID, EOS_ID, Tokenizer
from mtrain.decoding.search import BeamStep, GreedyStep
from mtrain.model.transformer import Transformer


@dataclass
class AxisLabels:
    """The pieces along the axes of a sentence's attention maps."""

    source: list[str]  # keys of cross-attention; queries and keys of the encoder's
    decoder_input: list[str]  # <s> y1 ..: queries and keys of the decoder's self-attention
    output: list[str]  # y1 .. (</s>): queries of cross-attention, by the piece each chose


@dataclass
class AttentionMaps:
    """One sentence's attention weights, one (n_heads, queries, keys) tensor per layer."""

    encoder: list[torch.Tensor]  # (h, S, S): source pieces over source pieces
    decoder: list[torch.Tensor]  # (h, T, T): decoder inputs over decoder inputs (look-ahead)
    cross: list[torch.Tensor]  # (h, T, S): output pieces over source pieces

    def axis_labels(self, src: list[int], tokens: list[int], tokenizer: Tokenizer) -> AxisLabels:
        """The pieces of source `src` and output `tokens` (without </s>) along the maps' axes."""
        ended = self.cross[0].size(1) > len(tokens)  # a last query row that chose </s>
        out_ids = [*tokens, EOS_ID] if ended else tokens
        return AxisLabels(
            source=tokenizer.src.id_to_piece(src),
            decoder_input=tokenizer.tgt.id_to_piece([BOS_ID, *out_ids[:-1]]),
            output=tokenizer.tgt.id_to_piece(out_ids),
        )


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
