"""Scoring a given translation by teacher forcing: how likely the model finds each of its pieces.

The decoder reads `<s> y1 .. yn` and predicts `y1 .. yn </s>` in one pass, as in training;
each reference piece gets its log-probability (among the pieces a search may output), its rank
among the model's choices at that position, and the model's own likeliest pieces there. A source
or target longer than the model reads (data.max_src_len, data.max_tgt_len) is scored cut, as it
is translated, and its score says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from mtrain.data.batching import length_batches
from mtrain.data.pairs import pad
from mtrain.data.text import normalize
from mtrain.data.tokenizer import BOS_ID, EOS_ID, fit, too_long
from mtrain.decoding.search import allowed
from mtrain.decoding.translator import Source, Translator

TOP_K = 5  # the model's own choices shown at each position


@dataclass
class PieceScore:
    """One target piece as the model saw it, its decoder input being the pieces before it."""

    piece: str
    id: int
    log_prob: float  # natural log of the model's probability of this piece here
    rank: int  # 1: the model's own first choice here
    top: list[tuple[str, float]]  # the model's likeliest pieces here, with their log-probabilities


@dataclass
class Score:
    """A translation's score: its pieces, </s> last, each with its log-probability."""

    source: str
    target: str
    pieces: list[PieceScore]
    truncated: list[str] = field(default_factory=list)  # "source", "target": scored cut

    @property
    def total(self) -> float:
        """The log-probability of the whole translation, </s> included."""
        return sum(p.log_prob for p in self.pieces)

    @property
    def mean(self) -> float:
        """The log-probability per piece, </s> included."""
        return self.total / len(self.pieces)

    def to_dict(self) -> dict:
        """As plain JSON-ready values."""
        pieces = [asdict(p) | {"top": [list(t) for t in p.top]} for p in self.pieces]
        return {
            "source": self.source,
            "target": self.target,
            "total": self.total,
            "mean": self.mean,
            "pieces": pieces,
            "truncated": self.truncated,
        }

    def __str__(self) -> str:
        width = max(len(p.piece) for p in self.pieces)
        lines = [f"{self.source} → {self.target}"]
        for p in self.pieces:
            best = ", ".join(f"{piece} {lp:.2f}" for piece, lp in p.top[:3])
            lines.append(f"  {p.piece:<{width}}  {p.log_prob:8.4f}  rank {p.rank:<5} ({best})")
        lines.append(f"  total {self.total:.4f}, mean {self.mean:.4f} per piece")
        if self.truncated:
            lines.append(f"  ({' and '.join(self.truncated)} cut to the model's length limit)")
        return "\n".join(lines)


def target_ids(translator: Translator, texts: list[str]) -> list[list[int]]:
    """Each target normalised and encoded as training encodes it, not cut."""
    normalized = [normalize(t, translator.cfg.data.tgt_lang) for t in texts]
    return translator.tokenizer.encode_tgt(normalized)


def score_pairs(
    translator: Translator, sources: list[str], targets: list[str], k: int = TOP_K
) -> list[Score]:
    """Each (source, target) pair's score, in batches of similar lengths; a side longer than
    the model reads is cut to its limit, and named in the score's `truncated`."""
    read = translator.sources(sources)
    src_ids = [s.ids or [EOS_ID] for s in read]  # an empty source: </s>
    max_tgt_len = translator.cfg.data.max_tgt_len
    encoded = target_ids(translator, targets)
    pieces = score_ids(translator, src_ids, [fit(t, max_tgt_len) for t in encoded], k)
    cut = [cut_sides(s, t, max_tgt_len) for s, t in zip(read, encoded)]
    return [Score(s, t, p, c) for s, t, p, c in zip(sources, targets, pieces, cut)]


def cut_sides(source: Source, target: list[int], max_tgt_len: int) -> list[str]:
    """The sides of a pair longer than the model reads, which are scored cut."""
    sides = {"source": source.truncated, "target": too_long(target, max_tgt_len)}
    return [side for side, cut in sides.items() if cut]


@torch.inference_mode()
def score_ids(
    translator: Translator,
    src_ids: list[list[int]],
    tgt_ids: list[list[int]],
    k: int = TOP_K,
    end: bool = True,
) -> list[list[PieceScore]]:
    """Each target's pieces scored given its source (ids, </s> last), in batches of similar
    lengths, each read back from the device once; `end`: </s> is added and scored (False: an
    output cut at its length limit)."""
    model, pieces = translator.model, translator.tokenizer.tgt
    model.eval()
    results: list[list[PieceScore]] = [[] for _ in src_ids]
    lengths = [len(s) + len(t) + 1 for s, t in zip(src_ids, tgt_ids)]
    for batch in length_batches(lengths, translator.decode.batch_tokens):
        outs = [[*tgt_ids[i], EOS_ID] if end else tgt_ids[i] for i in batch]  # what is predicted
        src = pad([src_ids[i] for i in batch]).to(translator.device)  # (B, S)
        tgt_in = pad([[BOS_ID, *tgt_ids[i]][: len(out)] for i, out in zip(batch, outs)])  # (B, T)
        tgt_in, tgt_out = tgt_in.to(translator.device), pad(outs).to(translator.device)
        log_probs = torch.log_softmax(allowed(model(src, tgt_in)), dim=-1)  # (B, T, V)
        ref = log_probs.gather(2, tgt_out[..., None])  # (B, T, 1)
        rank = (log_probs > ref).sum(dim=2, keepdim=True) + 1  # (B, T, 1)
        n = min(k, log_probs.size(-1))
        top_lp, top_ids = log_probs.topk(n, dim=-1)  # (B, T, n)
        # One read of the device for the batch: float64 holds the ids and ranks exactly.
        table = torch.cat([t.double() for t in (ref, rank, top_lp, top_ids)], dim=2).tolist()
        for row, (i, out) in enumerate(zip(batch, outs)):
            results[i] = [
                PieceScore(
                    pieces.id_to_piece(t),
                    t,
                    log_prob,
                    int(place),
                    list(zip(pieces.id_to_piece([int(c) for c in top[n:]]), top[:n])),
                )
                for t, (log_prob, place, *top) in zip(out, table[row])
            ]
    return results
