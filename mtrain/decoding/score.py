"""Scoring a given translation by teacher forcing: how likely the model finds each of its pieces.

The decoder reads `<s> y1 .. yn` and predicts `y1 .. yn </s>` in one pass, as in training;
each reference piece gets its log-probability (among the pieces a search may output), its rank
among the model's choices at that position, and the model's own likeliest pieces there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from mtrain.data.batching import length_batches
from mtrain.data.pairs import pad
from mtrain.data.text import normalize
from mtrain.data.tokenizer import BOS_ID, EOS_ID, fit
from mtrain.decoding.search import allowed
from mtrain.decoding.translator import Translator

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
        }

    def __str__(self) -> str:
        width = max(len(p.piece) for p in self.pieces)
        lines = [f"{self.source} → {self.target}"]
        for p in self.pieces:
            best = ", ".join(f"{piece} {lp:.2f}" for piece, lp in p.top[:3])
            lines.append(f"  {p.piece:<{width}}  {p.log_prob:8.4f}  rank {p.rank:<5} ({best})")
        lines.append(f"  total {self.total:.4f}, mean {self.mean:.4f} per piece")
        return "\n".join(lines)


def target_ids(translator: Translator, texts: list[str]) -> list[list[int]]:
    """Each target normalised and encoded as training encodes it, cut to data.max_tgt_len."""
    cfg = translator.cfg.data
    normalized = [normalize(t, cfg.tgt_lang) for t in texts]
    return [fit(ids, cfg.max_tgt_len) for ids in translator.tokenizer.encode_tgt(normalized)]


def score_pairs(
    translator: Translator, sources: list[str], targets: list[str], k: int = TOP_K
) -> list[Score]:
    """Each (source, target) pair's score, in batches of similar lengths."""
    src_ids = [s.ids or [EOS_ID] for s in translator.sources(sources)]  # an empty source: </s>
    tgt_ids = target_ids(translator, targets)
    pieces = score_ids(translator, src_ids, tgt_ids, k)
    return [Score(s, t, p) for s, t, p in zip(sources, targets, pieces)]


@torch.inference_mode()
def score_ids(
    translator: Translator,
    src_ids: list[list[int]],
    tgt_ids: list[list[int]],
    k: int = TOP_K,
    end: bool = True,
) -> list[list[PieceScore]]:
    """Each target's pieces scored given its source (ids, </s> last), in batches of similar
    lengths; `end`: </s> is added and scored (False: an output cut at its length limit)."""
    model, tokenizer = translator.model, translator.tokenizer
    model.eval()
    results: list[list[PieceScore]] = [[] for _ in src_ids]
    lengths = [len(s) + len(t) + 1 for s, t in zip(src_ids, tgt_ids)]
    for batch in length_batches(lengths, translator.decode.batch_tokens):
        src = pad([src_ids[i] for i in batch]).to(translator.device)  # (B, S)
        tgt_in = pad([[BOS_ID, *tgt_ids[i]][: len(tgt_ids[i]) + end] for i in batch])  # (B, T)
        tgt_in = tgt_in.to(translator.device)
        log_probs = torch.log_softmax(allowed(model(src, tgt_in)), dim=-1)  # (B, T, V)
        top_lp, top_ids = log_probs.topk(min(k, log_probs.size(-1)), dim=-1)  # (B, T, k)
        for row, i in enumerate(batch):
            out = [*tgt_ids[i], EOS_ID] if end else tgt_ids[i]  # what each position predicts
            lp = log_probs[row, : len(out)]  # (n, V)
            ref = lp.gather(1, torch.tensor(out, device=lp.device)[:, None])[:, 0]  # (n,)
            ranks = ((lp > ref[:, None]).sum(dim=1) + 1).tolist()  # (n,)
            results[i] = [
                PieceScore(
                    tokenizer.tgt.id_to_piece(t),
                    t,
                    ref[j].item(),
                    ranks[j],
                    list(
                        zip(
                            tokenizer.tgt.id_to_piece(top_ids[row, j].tolist()),
                            top_lp[row, j].tolist(),
                        )
                    ),
                )
                for j, t in enumerate(out)
            ]
    return results
