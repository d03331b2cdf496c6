"""`mtrain lab`: variants trained beside a baseline, resumed where a lab stopped, and reported;
the paired bootstrap it shares with scripts/compare_dev.py, recomputed by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from sacrebleu.metrics import BLEU

import mtrain
from mtrain.core.config import load
from mtrain.core.errors import OptionError
from mtrain.core.metrics import score
from mtrain.core.significance import SAMPLES, SEED, holm, paired_bootstrap, resample_counts
from mtrain.laboratory.plan import LAB_VARIANTS, PRESETS, Budget, make_lab, parse_variant
from mtrain.laboratory.report import COLUMNS
from mtrain.laboratory.results import eval_set
from mtrain.run.directory import LAST, peek_checkpoint, run_config

from .console import mtrain as mtrain_command

UPDATES = 10  # one train.jsonl record (every 10 updates) and one validation


def test_one_sentence_bootstrap_is_hand_computable() -> None:
    """With one sentence, every resample is that sentence: each resampled difference is the
    real one, none lies on the far side of 0, and the p-value is 2 (0 + 1) / (samples + 1)."""
    refs = [["the dog bites the man"]]
    base, other = ["the dog bites a man"], ["the dog bites the man"]
    compared = paired_bootstrap([("base", base), ("other", other)], refs, "en", samples=99)
    assert compared[0].p_value is None
    assert compared[1].p_value == pytest.approx(2 / 100)
    assert compared[1].bleu == BLEU().corpus_score(other, [["the dog bites the man"]]).score
    delta = compared[1].bleu - compared[0].bleu
    assert (compared[1].low, compared[1].high) == (pytest.approx(delta), pytest.approx(delta))
    assert compared[1].ci == pytest.approx(0.0, abs=1e-6)  # every resample scores alike


def test_no_difference_has_p_value_1() -> None:
    refs = [["a cat sat"], ["the man bit a dog"], ["who am I"]]
    hyps = ["a cat sat down", "a dog bit the man", "who am I"]
    compared = paired_bootstrap([("a", hyps), ("b", list(hyps))], refs, "en")
    assert compared[1].p_value == 1.0


def test_every_named_variant_and_preset_is_a_valid_config() -> None:
    for overrides in LAB_VARIANTS.values():
        load(Path("configs/tiny.yaml"), list(overrides))
    for preset in PRESETS.values():
        assert preset.config.is_file()
        assert set(preset.variants) <= set(LAB_VARIANTS)


def test_variants_of_ones_own_and_refusals() -> None:
    own = parse_variant("3+1: model.n_encoder_layers=3 model.n_decoder_layers=1")
    assert own.overrides == ("model.n_encoder_layers=3", "model.n_decoder_layers=1")
    assert parse_variant("one-head").overrides == ("model.n_heads=1",)
    for bad in ("nope", "baseline: model.n_heads=1", "a/b: model.n_heads=1", "x:", "x: n_heads"):
        with pytest.raises(OptionError):
            parse_variant(bad)
    with pytest.raises(OptionError):
        Budget()
    with pytest.raises(OptionError):
        Budget(updates=10, minutes=1.0)
    with pytest.raises(OptionError):
        make_lab(Path("configs/tiny.yaml"), ["one-head", "one-head"], updates=1)


def lab_options(corpus: dict[str, str]) -> list[str]:
    return [
        *(f"data.{k}={v}" for k, v in corpus.items()),
        "tokenizer.vocab_size=300",
        f"train.eval_every={UPDATES}",
    ]


def test_a_bad_variant_is_refused_before_anything_is_trained(corpus, tmp_path) -> None:
    sets = [a for o in lab_options(corpus) for a in ("--set", o)]
    out = tmp_path / "lab"
    base = ["lab", "-c", "configs/tiny.yaml", "--updates", "1", "--out", str(out), *sets]
    named = mtrain_command(*base, "nope")
    assert named.returncode == 2
    assert "variant 'nope': not one of no-positions" in named.stderr
    own = mtrain_command(*base, "odd: model.heads=1")
    assert own.returncode == 2
    assert "lab run odd-seed1" in own.stderr and "model.heads" in own.stderr
    assert len(own.stderr.strip().splitlines()) == 1
    assert not out.exists()


def report_table(path: Path) -> tuple[list[str], list[list[str]]]:
    """report.md's first table: its header and its rows, as cells."""
    lines = path.read_text("utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| variant"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return [c.strip() for c in lines[start].strip("|").split("|")], rows


def stamp(run: Path) -> tuple[int, int]:
    return (run / LAST).stat().st_mtime_ns, peek_checkpoint(run / LAST)["step"]


def test_lab_end_to_end_and_resumed(corpus, tmp_path, caplog) -> None:
    """The command trains the baseline and one variant; the Python API, given another alone,
    trains that one (the lab goes on where it stopped, its speed timed again) and reports all
    three: every variant the lab holds."""
    out = tmp_path / "lab"
    sets = [a for o in lab_options(corpus) for a in ("--set", o)]
    first = mtrain_command(
        "lab",
        "one-head",
        "-c",
        "configs/tiny.yaml",
        "--updates",
        str(UPDATES),
        "--out",
        str(out),
        "--probe",
        "我打他",
        "--probe",
        "他打我",
        "--device",
        "cpu",
        *sets,
    )
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("| variant | changes | seed |")  # the table alone on stdout
    assert "run 2 of 2: one-head-seed1" in first.stderr
    before = {name: stamp(out / name) for name in ("baseline-seed1", "one-head-seed1")}

    caplog.set_level("INFO")
    rows = mtrain.lab(
        "configs/tiny.yaml",
        "post: model.norm=post",
        out,
        updates=UPDATES,
        overrides=lab_options(corpus),
        probes=["我打他", "他打我"],
        device="cpu",
    )
    assert {name: stamp(out / name) for name in before} == before  # not trained again
    assert re.search(r"lab: 3 runs of 10 updates \(1 to train\); .* measured here", caplog.text)
    assert [(r.variant, r.seed, r.updates) for r in rows] == [
        ("baseline", 1, UPDATES),
        ("one-head", 1, UPDATES),
        ("post", 1, UPDATES),
    ]
    assert rows[0].p_value is None
    assert [r.p_holm for r in rows[1:]] == holm([r.p_value for r in rows[1:]])
    test = eval_set(run_config(out / "baseline-seed1").data, "test")
    for r in rows[1:]:
        assert_the_bootstrap_of(r, out, test)

    header, cells = report_table(out / "report.md")
    assert header == list(COLUMNS)
    assert [c[0] for c in cells] == ["baseline", "one-head", "post"]
    for row, line in zip(rows, cells):
        assert int(line[COLUMNS.index("last step")]) == UPDATES
        assert float(line[COLUMNS.index("dev BLEU")]) == pytest.approx(row.dev_bleu, abs=0.01)
        assert float(line[COLUMNS.index("test BLEU")]) == pytest.approx(row.test_bleu, abs=0.01)
    assert [c[COLUMNS.index("p (Holm)")].split()[0] for c in cells[1:]] == [
        f"{r.p_holm:.3f}" for r in rows[1:]
    ]
    page = (out / "report.html").read_text("utf-8")
    assert "他打我" in page and "@font-face" in page and page.count("<img") == 3
    for figure in ("curves.png", "differences.png", "attention.png"):
        assert (out / figure).stat().st_size > 1000


def assert_the_bootstrap_of(row, out: Path, test) -> None:
    """A variant's row against the bootstrap recomputed here: its first resamples' differences
    are sacreBLEU's corpus BLEU of the resampled corpus, and its interval and p-value are the
    order statistics and the tail count of its resampled differences."""
    kept = {
        name: json.loads((out / "translations" / f"{name}.json").read_text("utf-8"))["test"]
        for name in ("baseline-seed1", row.name)
    }
    n = len(test.references)
    counts = resample_counts(n, SAMPLES, SEED)
    for b in range(2):
        drawn = [i for i in range(n) for _ in range(counts[b, i])]
        refs = [test.references[i] for i in drawn]
        base, ours = (score([h[i] for i in drawn], refs, "en").bleu for h in kept.values())
        assert row.resampled[b] == pytest.approx(ours - base, abs=1e-9)
    ordered = sorted(row.resampled)
    assert row.interval == (ordered[24], ordered[SAMPLES - 25])  # 2.5% and 97.5% of 1,000
    far = min(sum(d <= 0 for d in ordered), sum(d >= 0 for d in ordered))
    assert row.p_value == min(1.0, 2 * (far + 1) / (SAMPLES + 1))


def test_an_unknown_preset_is_refused() -> None:
    with pytest.raises(OptionError, match="--preset 'slow'"):
        make_lab(None, [], preset="slow")
    with pytest.raises(OptionError, match="--config"):
        make_lab(None, [], updates=1)
