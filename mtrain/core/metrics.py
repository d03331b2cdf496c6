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


@dataclass
class Compared:
    """One system's BLEU beside the baseline's, by sacrebleu's paired bootstrap resampling."""

    name: str
    bleu: float
    mean: float  # the bootstrap resamples' mean BLEU
    ci: float  # half the width of its 95% confidence interval
    p_value: float | None  # None for the baseline itself
    signature: str


def paired_bootstrap(
    systems: list[tuple[str, list[str]]],
    references: list[list[str]],
    tgt_lang: str,
    samples: int = 1000,
) -> list[Compared]:
    """Each system against the first (the baseline): what `sacrebleu --paired-bs` computes,
    with its fixed seed. A system whose BLEU is the baseline's gets p = 1: sacrebleu counts the
    resamples whose difference exceeds the real one strictly, and so gives two systems that
    score alike on every resample (identical outputs, or both 0) 1/(samples + 1), the smallest
    p-value it can give, where there is no difference at all to explain."""
    from sacrebleu.significance import PairedTest

    if len(systems) < 2:
        raise ValueError("a paired test needs a baseline and at least one system")
    bleu = BLEU(tokenize=BLEU_TOKENIZERS.get(tgt_lang, "13a"))
    test = PairedTest(
        systems, {"BLEU": bleu}, reference_streams(references), test_type="bs", n_samples=samples
    )
    signatures, scores = test()
    base = scores["BLEU"][0].score
    return [
        Compared(
            name,
            result.score,
            float(result.mean),
            float(result.ci),
            None if i == 0 else 1.0 if result.score == base else float(result.p_value),
            str(signatures["BLEU"]),
        )
        for i, (name, result) in enumerate(zip(scores["System"], scores["BLEU"]))
    ]
