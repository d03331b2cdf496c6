"""A lab's runs, measured: each one's logs and dev translations, compared with the baseline."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from mtrain.core import jsonl
from mtrain.core.files import write_atomic
from mtrain.core.metrics import paired_bootstrap, score
from mtrain.data.corpus import corpora, read_pairs
from mtrain.data.pairs import group_references
from mtrain.decoding.loaded import open_run
from mtrain.laboratory.plan import BASELINE, LabRun
from mtrain.run.directory import BEST, METRICS, TRAIN_LOG, run_config, training_summary

log = logging.getLogger("mtrain")

TRANSLATIONS = "translations"  # LAB_DIR/translations/<run>.json: a checkpoint's, kept


@dataclass
class LabRow:
    """One run of a lab, measured; `p_value` against the baseline of the same seed."""

    variant: str
    seed: int
    updates: int
    minutes: float
    train_loss: float | None  # the last logged (label-smoothed) training loss
    dev_loss: float | None  # at the last validation
    dev_bleu: float  # best.pt's greedy translation of the dev set
    p_value: float | None  # None for the baseline
    run_dir: Path


@dataclass
class Translations:
    """What one run's best.pt made of the dev set and the probes (greedy)."""

    step: int
    dev: list[str]
    probes: dict[str, str]


def translations(
    run_dir: Path, lab_dir: Path, sources: list[str], probes: tuple[str, ...], device: str
) -> Translations:
    """The run's greedy translations, from LAB_DIR/translations/ while its best.pt is the same."""
    best = (run_dir / BEST).resolve()
    kept_file = lab_dir / TRANSLATIONS / f"{run_dir.name}.json"
    key = {"checkpoint": best.name, "mtime_ns": best.stat().st_mtime_ns}
    kept = read_kept(kept_file)
    if (
        kept.get("key") == key
        and len(kept["dev"]) == len(sources)
        and set(probes) <= set(kept["probes"])
    ):
        return Translations(kept["step"], kept["dev"], kept["probes"])
    log.info("%s: translating the dev set and the probes", run_dir.name)
    opened = open_run(run_dir, device, BEST, beam=1)
    translate = opened.translator.translate
    found = Translations(
        opened.run.step or 0, translate(sources), dict(zip(probes, translate(list(probes))))
    )
    kept_file.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(kept_file, json.dumps({"key": key, **asdict(found)}, ensure_ascii=False))
    return found


def read_kept(path: Path) -> dict:
    """The translations a lab kept of a checkpoint; {} if none (or not readable: made again)."""
    try:
        kept = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) and {"step", "dev", "probes"} <= kept.keys() else {}


def dev_set(run_dir: Path) -> tuple[list[str], list[list[str]], str]:
    """The dev sources of a run's config, each once with all its references; the target language."""
    data = run_config(run_dir).data
    pairs = [
        p
        for c in corpora(data.dev, data.swap_columns)
        for p in read_pairs(c, data.src_lang, data.tgt_lang, scored=True)
    ]
    sources, references = group_references(pairs)
    return sources, references, data.tgt_lang


def last(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return values[-1] if values else None


def measure(
    runs: list[LabRun], lab_dir: Path, probes: tuple[str, ...], device: str, samples: int = 1000
) -> tuple[list[LabRow], dict[str, Translations]]:
    """Each trained run's row, its p-value against its seed's baseline, and its translations."""
    done = [r for r in runs if (lab_dir / r.name / BEST).is_file()]
    if not done:
        return [], {}
    sources, references, tgt_lang = dev_set(lab_dir / done[0].name)
    found = {r.name: translations(lab_dir / r.name, lab_dir, sources, probes, device) for r in done}
    p_values: dict[str, float | None] = {}
    for seed in dict.fromkeys(r.seed for r in done):
        base = f"{BASELINE}-seed{seed}"
        others = [r.name for r in done if r.seed == seed and r.variant != BASELINE]
        if base in found and others:
            systems = [(name, found[name].dev) for name in (base, *others)]
            for c in paired_bootstrap(systems, references, tgt_lang, samples)[1:]:
                p_values[c.name] = c.p_value
    return [row(r, lab_dir, found[r.name], references, tgt_lang, p_values) for r in done], found


def row(
    run: LabRun,
    lab_dir: Path,
    found: Translations,
    references: list[list[str]],
    tgt_lang: str,
    p_values: dict[str, float | None],
) -> LabRow:
    run_dir = lab_dir / run.name
    summary = training_summary(run_dir)
    validations = [r for r in jsonl.read(run_dir / METRICS) if r.get("event") != "average"]
    return LabRow(
        run.variant,
        run.seed,
        summary["steps"],
        summary["minutes"],
        last(jsonl.read(run_dir / TRAIN_LOG), "loss"),
        last(validations, "dev_loss"),
        score(found.dev, references, tgt_lang).bleu,
        p_values.get(run.name),
        run_dir,
    )
