"""Corpus BLEU and chrF with sacrebleu, with any number of references per sentence."""

from __future__ import annotations

from dataclasses import dataclass

from sacrebleu.metrics import BLEU, CHRF

BLEU_TOKENIZERS = {"zh": "zh"}  # every other target language: 13a


@dataclass
class Scores:
    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str


def reference_streams(references: list[list[str]]) -> list[list[str | None]]:
    """Per-sentence reference lists -> sacrebleu's streams, None where a sentence has fewer."""
    n = max((len(r) for r in references), default=1)
    return [[refs[j] if j < len(refs) else None for refs in references] for j in range(n)]


def score(hypotheses: list[str], references: list[list[str]], tgt_lang: str) -> Scores:
    """Score hypotheses against one or more references each; BLEU tokenises for `tgt_lang`."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} reference sets")
    if not all(references):
        raise ValueError("every sentence needs at least one reference")
    streams = reference_streams(references)
    bleu = BLEU(tokenize=BLEU_TOKENIZERS.get(tgt_lang, "13a"))
    chrf = CHRF()
    return Scores(
        bleu=bleu.corpus_score(hypotheses, streams).score,
        chrf=chrf.corpus_score(hypotheses, streams).score,
        bleu_signature=str(bleu.get_signature()),
        chrf_signature=str(chrf.get_signature()),
    )
