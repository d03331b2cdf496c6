"""A lab's runs, measured: each one's logs and translations (dev, test, probes), compared with
the baseline of its seed on the test set, and each variant's verdict over its seeds."""

from __future__ import annotations

import itertools
import json
import logging
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from mtrain.core import jsonl
from mtrain.core.config import DataConfig
from mtrain.core.files import write_atomic
from mtrain.core.metrics import score
from mtrain.core.significance import (
    ALPHA,
    SAMPLES,
    MeanDifference,
    holm,
    mean_difference,
    paired_bootstrap,
    pooled_seed_variance,
)
from mtrain.data.corpus import corpora, read_pairs
from mtrain.data.pairs import group_references
from mtrain.data.prepared import sha256
from mtrain.decoding.loaded import open_run
from mtrain.laboratory.plan import BASELINE, LabRun
from mtrain.run.directory import (
    BEST,
    LAST,
    TRAIN_LOG,
    CheckpointError,
    checkpoint_step,
    peek_checkpoint,
    run_config,
    training_summary,
)

log = logging.getLogger("mtrain")

TRANSLATIONS = "translations"  # LAB_DIR/translations/<run>.json: a checkpoint's, kept


@dataclass
class LabRow:
    """One run of a lab, measured. BLEU is best.pt's greedy translation: of the dev set (what
    chose best.pt) and of the test set (what the lab reports). `delta`, `interval` and the
    p-values compare its test BLEU with the baseline's of the same seed by the paired bootstrap
    (None for the baseline, and where either run has no BLEU); `p_holm` is Holm-adjusted over
    the variants compared with that baseline; `resampled` holds `delta` on each resample of the
    test set, the same resamples for every seed. A run without BLEU says why in `status`."""

    variant: str
    seed: int
    changes: tuple[str, ...]  # the variant's config changes; () for the baseline
    status: str  # "" where measured; else "diverged at step 212: ...", "never validated", ...
    parameters: int | None
    dropout: float | None
    updates_per_s: float | None  # the median rate between training log records
    best_step: int | None  # best.pt's
    updates: int | None  # last.pt's step: the updates trained
    minutes: float  # since the start of training, validations included
    dev_bleu: float | None
    test_bleu: float | None
    delta: float | None  # test BLEU minus the baseline's
    interval: tuple[float, float] | None  # the bootstrap's 95% interval of `delta`
    p_value: float | None  # two-sided: below ALPHA exactly where `interval` leaves out 0
    p_holm: float | None
    run_dir: Path
    resampled: np.ndarray | None = field(default=None, repr=False)  # (SAMPLES,)

    @property
    def name(self) -> str:
        return self.run_dir.name

    @property
    def significant(self) -> bool:
        return self.p_holm is not None and self.p_holm < ALPHA


@dataclass
class Translations:
    """What one run's best.pt made of the dev set, the test set and the probes (greedy)."""

    step: int
    dev: list[str]
    test: list[str]
    probes: dict[str, str]


@dataclass
class EvalSet:
    """A corpus's sources, each once with all its references, and the target language."""

    sources: list[str]
    references: list[list[str]]
    tgt_lang: str


def eval_set(data: DataConfig, split: str) -> EvalSet:
    """The dev or test sources of a config's data section, each once with all its references."""
    pairs = [
        p
        for c in corpora(getattr(data, split), data.swap_columns)
        for p in read_pairs(c, data.src_lang, data.tgt_lang, scored=True)
    ]
    sources, references = group_references(pairs)
    return EvalSet(sources, references, data.tgt_lang)


def run_translations(
    run_dir: Path, lab_dir: Path, dev: EvalSet, test: EvalSet, probes: tuple[str, ...], device: str
) -> Translations:
    """The run's greedy translations, from LAB_DIR/translations/ while its best.pt and the dev
    and test sources are the same (the references are not translated: BLEU is scored afresh)."""
    best = (run_dir / BEST).resolve()
    kept_file = lab_dir / TRANSLATIONS / f"{run_dir.name}.json"
    sources = sha256(json.dumps([dev.sources, test.sources], ensure_ascii=False))
    key = {"checkpoint": best.name, "mtime_ns": best.stat().st_mtime_ns, "sources": sources}
    kept = read_kept(kept_file)
    if kept.get("key") == key and set(probes) <= set(kept["probes"]):
        return Translations(kept["step"], kept["dev"], kept["test"], kept["probes"])
    log.info("%s: translating the dev set, the test set and the probes", run_dir.name)
    opened = open_run(run_dir, device, BEST, beam=1)
    translate = opened.translator.translate
    translated = Translations(
        opened.run.step or 0,
        translate(dev.sources),
        translate(test.sources),
        dict(zip(probes, translate(list(probes)))),
    )
    kept_file.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(kept_file, json.dumps({"key": key, **asdict(translated)}, ensure_ascii=False))
    return translated


def read_kept(path: Path) -> dict:
    """The translations a lab kept of a checkpoint; {} if none (or not readable: made again)."""
    try:
        kept = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    fields = {"key", "step", "dev", "test", "probes"}
    return kept if isinstance(kept, dict) and fields <= kept.keys() else {}


def parameter_count(path: Path) -> int | None:
    """The parameters of a checkpoint's model, a tied matrix counted once; None if unreadable."""
    try:
        tensors = peek_checkpoint(path)["model"].values()
    except (CheckpointError, KeyError):
        return None
    storages = {(t.untyped_storage().data_ptr(), t.storage_offset()): t.numel() for t in tensors}
    return sum(storages.values())


def logged_updates_per_second(run_dir: Path) -> float | None:
    """The median rate between training log records (from the start, then between records):
    validations and the start (a slow first batch, compiling) fall into a few of the intervals
    and do not move the median."""
    logged = [(r["step"], r["minutes"]) for r in jsonl.read(run_dir / TRAIN_LOG) if "minutes" in r]
    records = [(0, 0.0), *sorted(logged)]
    rates = [
        (s2 - s1) / ((m2 - m1) * 60)
        for (s1, m1), (s2, m2) in itertools.pairwise(records)
        if s2 > s1 and m2 > m1
    ]
    return statistics.median(rates) if rates else None


def why_unmeasured(run_dir: Path, diverged: str | None) -> str:
    """ "" for a run with a best.pt to measure; else why it has none."""
    if diverged:
        return diverged
    if (run_dir / BEST).is_file():
        return ""
    if (run_dir / LAST).is_file():
        return "never validated: no best.pt (train.eval_every beyond its updates?)"
    return "not trained"


def run_row(
    run: LabRun, run_dir: Path, status: str, translated: Translations | None, dev: EvalSet | None
) -> LabRow:
    """A run's row before it is compared: what it is, how it trained, its dev BLEU."""
    trained = (run_dir / LAST).is_file()
    checkpoint = run_dir / (LAST if trained else BEST)
    dev_bleu = None
    if translated is not None and dev is not None:
        dev_bleu = score(translated.dev, dev.references, dev.tgt_lang).bleu
    return LabRow(
        run.variant,
        run.seed,
        run.changes,
        status,
        parameter_count(checkpoint) if checkpoint.is_file() else None,
        run_config(run_dir).model.dropout if checkpoint.is_file() else None,
        logged_updates_per_second(run_dir),
        None if translated is None else translated.step,
        checkpoint_step(run_dir / LAST, 0) if trained else None,
        training_summary(run_dir)["minutes"] if checkpoint.is_file() else 0.0,
        dev_bleu,
        None,  # the test BLEU and the comparison: compare()'s
        None,
        None,
        None,
        None,
        run_dir,
    )


def compare(rows: list[LabRow], translations: Mapping[str, Translations], test: EvalSet) -> None:
    """Fill in each row's test BLEU and, seed by seed, its paired bootstrap against the
    baseline: the difference, its 95% interval, its p-value and Holm's over the variants. Every
    seed's bootstrap draws the same resamples (one generator seed, one test set)."""
    for row in rows:
        if row.name in translations:
            row.test_bleu = score(translations[row.name].test, test.references, test.tgt_lang).bleu
    for seed in dict.fromkeys(r.seed for r in rows):
        base = next((r for r in rows if r.seed == seed and r.variant == BASELINE), None)
        others = [
            r for r in rows if r.seed == seed and r.variant != BASELINE and r.name in translations
        ]
        if base is None or base.name not in translations or not others:
            continue
        systems = [(r.name, translations[r.name].test) for r in (base, *others)]
        baseline, *compared = paired_bootstrap(systems, test.references, test.tgt_lang, SAMPLES)
        for row, c in zip(others, compared):
            row.delta = c.bleu - baseline.bleu
            row.interval = (c.low, c.high)
            row.p_value = c.p_value
            row.resampled = c.differences
        for row, p in zip(others, holm([r.p_value for r in others])):
            row.p_holm = p


def measure(
    runs: list[LabRun],
    lab_dir: Path,
    probes: tuple[str, ...],
    device: str,
    diverged: Mapping[str, str],
    data: DataConfig,
) -> tuple[list[LabRow], dict[str, Translations]]:
    """Every run's row (one without BLEU says why), compared with its seed's baseline on the
    test set of `data`; and the translations of the runs measured, by run name."""
    status = {r.name: why_unmeasured(lab_dir / r.name, diverged.get(r.name)) for r in runs}
    measured = [r for r in runs if not status[r.name]]
    translations: dict[str, Translations] = {}
    dev = test = None
    if measured:
        dev, test = eval_set(data, "dev"), eval_set(data, "test")
        translations = {
            r.name: run_translations(lab_dir / r.name, lab_dir, dev, test, probes, device)
            for r in measured
        }
    rows = [
        run_row(r, lab_dir / r.name, status[r.name], translations.get(r.name), dev) for r in runs
    ]
    if test is not None:
        compare(rows, translations, test)
    return rows, translations


@dataclass
class Spread:
    """A mean over seeds and the sample standard deviation (None with one value)."""

    mean: float
    sd: float | None

    @classmethod
    def of(cls, values: list[float]) -> Spread | None:
        if not values:
            return None
        return cls(statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None)


@dataclass
class Summary:
    """A variant over the lab's seeds: its BLEU and its difference from the baseline."""

    variant: str
    rows: list[LabRow]  # its runs, seed by seed
    dev: Spread | None
    test: Spread | None
    delta: MeanDifference | None  # over the seeds compared (two or more), with its interval
    verdict: str


def summaries(rows: list[LabRow]) -> list[Summary]:
    """Each variant over its seeds (the baseline first). With two or more seeds compared, the
    mean difference's interval (`mean_difference`), its seed part from the seed variance of test
    BLEU pooled over the lab's systems (`seed_noise`), and the verdict on it (`seed_verdict`)."""
    variants = dict.fromkeys(r.variant for r in rows)
    by_variant = {v: [r for r in rows if r.variant == v] for v in variants}
    test_bleu = {
        v: [r.test_bleu for r in mine if r.test_bleu is not None] for v, mine in by_variant.items()
    }
    variance, df = seed_noise(list(test_bleu.values()))
    summed = []
    for variant, mine in by_variant.items():
        test = Spread.of(test_bleu[variant])
        compared = [r for r in mine if r.delta is not None and r.resampled is not None]
        delta = None
        if variant == BASELINE:
            verdict = noise_floor(test, len(test_bleu[variant]), variance, df)
        elif len(compared) >= 2 and df:
            resampled = [r.resampled for r in compared]
            delta = mean_difference([r.delta for r in compared], resampled, variance, df)
            verdict = seed_verdict(delta)
        elif len(compared) >= 2:
            verdict = "seed noise not measured: no system scored above 0 on two seeds"
        else:
            verdict = "compared on one seed only: see its line" if compared else "not compared"
        missing = [f"seed {r.seed}: {r.status}" for r in mine if r.status]
        summed.append(
            Summary(
                variant,
                mine,
                Spread.of([r.dev_bleu for r in mine if r.dev_bleu is not None]),
                test,
                delta,
                "; ".join([verdict, *missing]),
            )
        )
    return summed


def seed_noise(test_bleu: list[list[float]]) -> tuple[float, int]:
    """The variance of a run's test BLEU from seed to seed, pooled over the lab's systems (the
    baseline and every variant, each about its own mean: `test_bleu` holds each one's seeds),
    and its degrees of freedom. A system that translates nothing (test BLEU 0 on every seed)
    has no seed noise to show: left out."""
    return pooled_seed_variance([g for g in test_bleu if any(g)])


def noise_floor(noise: Spread | None, seeds: int, variance: float, df: int) -> str:
    if noise is None or noise.sd is None:
        return "the baseline (one seed measured: seed noise unknown)"
    pooled = f"; pooled over the lab: sd {variance**0.5:.2f}, {df} df" if df else ""
    return f"seed noise: test BLEU {noise.mean:.2f} ± {noise.sd:.2f} over {seeds} seeds{pooled}"


def bleu_text(value: float) -> str:
    """BLEU in words: one decimal, two where the number is under 1."""
    return f"{abs(value):.{1 if abs(value) >= 1 else 2}f}"


def seed_verdict(delta: MeanDifference) -> str:
    """The mean difference over seeds in words: better or worse where its 95% interval leaves
    out 0 ("a first sign" on two seeds, whose seed noise is a guess from few values), else
    within noise."""
    seeds = f"{delta.seeds} seeds"
    if not delta.beyond_noise:
        return f"within noise ({seeds})"
    size = f"{'better' if delta.mean > 0 else 'worse'} by {bleu_text(delta.mean)} BLEU"
    if delta.seeds == 2:
        return f"{size}: a first sign ({seeds})"
    return f"{size}, beyond noise ({seeds})"


def run_verdict(row: LabRow) -> str:
    """One run against its seed's baseline, by the paired bootstrap (test-set sampling only)."""
    if row.status:
        return row.status
    if row.variant == BASELINE:
        return "the baseline"
    if row.delta is None:
        return "no baseline of its seed to compare with"
    if row.significant:
        return (
            f"{'better' if row.delta > 0 else 'worse'} by {bleu_text(row.delta)} BLEU, significant"
        )
    return "within test-set noise"
