"""What a lab measures and reports: test BLEU beside dev BLEU, the paired bootstrap's interval,
Holm's correction, the seed noise and the verdicts, a run that diverged or never validated as a
row, and a report.md and report.html that escape what a probe holds."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

import mtrain
from mtrain.core.metrics import score
from mtrain.core.significance import SAMPLES, paired_bootstrap
from mtrain.laboratory.plan import Budget, Lab, parse_variant
from mtrain.laboratory.report import COLUMNS, markdown_table, report, table
from mtrain.laboratory.results import LabRow, eval_set, run_verdict, summaries
from mtrain.run.directory import LAST, finished_record, peek_checkpoint, run_config
from mtrain.training.state import Checkpoints
from mtrain.training.trainer import Interrupted

from .synthetic import REPO, resampled
from .test_lab import assert_the_bootstrap_of

UPDATES = 10


# The statistics, against hand-computed cases (the bootstrap's own: tests/test_significance.py).


def test_identical_systems_give_p_1_and_the_interval_0_0() -> None:
    refs = [["a cat sat"], ["the man bit a dog"], ["who am I"], ["I hit him"]]
    hyps = ["a cat sat down", "a dog bit the man", "who am I", "he hit me"]
    base, same = paired_bootstrap([("a", hyps), ("b", list(hyps))], refs, "en")
    assert (base.low, base.high) == (None, None)
    assert same.p_value == 1.0
    assert (same.low, same.high) == (0.0, 0.0)


def constructed(n: int = 200) -> tuple[list[list[str]], list[str], list[str]]:
    """A baseline right on every third sentence, a system right on every second."""
    refs = [[f"the {i} cats sat on the mat number {i}"] for i in range(n)]
    wrong = [f"a dog {i} stood near the door" for i in range(n)]
    base = [r[0] if i % 3 == 0 else w for i, (r, w) in enumerate(zip(refs, wrong))]
    system = [r[0] if i % 2 == 0 else w for i, (r, w) in enumerate(zip(refs, wrong))]
    return refs, base, system


def test_the_interval_holds_the_difference_and_is_nearly_symmetric() -> None:
    refs, base, system = constructed()
    _, compared = paired_bootstrap([("base", base), ("system", system)], refs, "en")
    observed = compared.bleu - score(base, refs, "en").bleu
    assert observed > 5
    assert compared.low < observed < compared.high
    assert compared.low > 0  # well away from 0: p-value at its floor, 2/1001
    assert compared.p_value == pytest.approx(2 / 1001)
    above, below = compared.high - observed, observed - compared.low
    assert 0.6 < above / below < 1.6  # a percentile interval; symmetric-ish on this case


# The verdicts, on given BLEU numbers.


def row(variant: str, seed: int, test: float | None, delta=None, p=None, status="") -> LabRow:
    """A run's row; its resampled differences `delta` itself on every resample (no test-set
    noise) unless given."""
    interval = None if delta is None else (delta - 0.5, delta + 0.5)
    dev = None if test is None else test + 1
    resampled = None if delta is None else np.full(SAMPLES, float(delta))
    return LabRow(
        variant, seed, () if variant == "baseline" else (f"x={variant}",), status,
        1000, 0.1, 10.0, 100, 120, 1.0, dev, test, delta, interval, p, p, Path(f"{variant}-{seed}"),
        resampled,
    )  # fmt: skip


def seeds_lab() -> list[LabRow]:
    """Baseline 20.0 and 20.4; three variants, two seeds each (one diverged on seed 2)."""
    rows = [row("baseline", 1, 20.0), row("baseline", 2, 20.4)]
    for variant, deltas, p_values in (
        ("worse", (-3.0, -3.2), (0.002, 0.002)),
        ("small", (-0.4, -0.5), (0.01, 0.01)),
        ("peek", (-20.0, -20.4), (0.002, 0.002)),  # translates nothing: BLEU 0
    ):
        rows += [
            row(variant, seed, base + d, d, p)
            for seed, base, d, p in zip((1, 2), (20.0, 20.4), deltas, p_values)
        ]
    rows.append(row("one-seed", 1, 17.0, -3.0, 0.002))
    rows.append(row("one-seed", 2, None, status="diverged at step 7: loss not finite"))
    return rows


def test_the_verdict_over_seeds_on_given_numbers() -> None:
    """By hand: the seed variance pooled over baseline, worse and small (peek, 0 on every
    seed, left out), (0.08 + 0.02 + 0.045) / 3 on 3 df; a mean line's interval is
    mean ± t(0.975, 3) √(2 s² / 2) without test-set noise."""
    found = {s.variant: s for s in summaries(seeds_lab())}
    s2 = (0.08 + 0.02 + 0.045) / 3
    assert found["baseline"].verdict == (
        f"seed noise: test BLEU 20.20 ± 0.28 over 2 seeds; pooled over the lab: sd "
        f"{s2**0.5:.2f}, 3 df"
    )
    half = 3.1824 * s2**0.5
    worse = found["worse"].delta
    assert (worse.mean, worse.df) == (pytest.approx(-3.1), 3)
    assert (worse.low, worse.high) == (pytest.approx(-3.1 - half, abs=1e-3),
                                       pytest.approx(-3.1 + half, abs=1e-3))  # fmt: skip
    assert found["worse"].verdict == "worse by 3.1 BLEU: a first sign (2 seeds)"
    assert found["small"].delta.half_width == pytest.approx(half, abs=1e-3)
    assert found["small"].verdict == "within noise (2 seeds)"  # 0.45 < 0.70
    assert found["one-seed"].verdict == (
        "compared on one seed only: see its line; seed 2: diverged at step 7: loss not finite"
    )
    assert found["worse"].test.mean == pytest.approx(17.1)


@pytest.mark.parametrize(
    ("seeds", "seed_sd", "test_sd"), [(2, 1.0, 0.1), (3, 1.0, 0.1), (5, 1.0, 0.1), (2, 0.1, 1.0)]
)
def test_a_variant_that_changes_nothing_is_rarely_beyond_noise(seeds, seed_sd, test_sd) -> None:
    """Simulated labs, a baseline and a variant that changes nothing: each run's test BLEU
    moves with its seed (seed_sd) and each system's with the test set (test_sd, the same for
    every seed, as the bootstrap's resamples are); the mean line is called better or worse in
    about 5% of labs (the rule it replaces: 16% on two seeds where seed noise dominates)."""
    rng = np.random.default_rng(seeds)
    labs, called = 1000, 0
    for _ in range(labs):
        shift = test_sd * rng.standard_normal()  # how this test set favours the variant
        noise = test_sd * rng.standard_normal(200)  # a resample's, the same for every seed
        rows = []
        for seed in range(1, seeds + 1):
            base, ours = 20 + seed_sd * rng.standard_normal(2) + (0, shift)
            rows.append(row("baseline", seed, base))
            rows.append(row("nothing", seed, ours, ours - base))
            rows[-1].resampled = ours - base + noise
        verdict = summaries(rows)[1].verdict
        called += verdict.startswith(("better", "worse"))
    assert 0.02 <= called / labs <= 0.08


def test_several_seeds_add_a_mean_line_per_variant() -> None:
    lines = table(seeds_lab())
    assert [line[0] for line in lines[:3]] == ["baseline"] * 3
    base_mean, worse = lines[2], lines[5]
    seed, delta = COLUMNS.index("seed"), COLUMNS.index("Δ test BLEU [95% interval]")
    assert (base_mean[seed], worse[seed]) == ("mean of 2", "mean of 2")
    assert base_mean[COLUMNS.index("test BLEU")] == "20.20 ± 0.28"
    mean = summaries(seeds_lab())[1].delta
    assert worse[delta] == f"-3.10 [{mean.low:.2f}, {mean.high:.2f}]"  # the mean's interval
    assert worse[COLUMNS.index("p (Holm)")] == "–"
    assert worse[-1] == "worse by 3.1 BLEU: a first sign (2 seeds)"
    assert lines[3][delta] == "-3.00 [-3.50, -2.50]"


def test_one_seed_verdicts_and_runs_without_bleu() -> None:
    assert run_verdict(row("x", 1, 17.0, -3.0, 0.001)) == "worse by 3.0 BLEU, significant"
    assert run_verdict(row("x", 1, 20.5, 0.5, 0.2)) == "within test-set noise"
    gone = row("x", 1, None, status="diverged at step 212: loss not finite")
    assert run_verdict(gone) == "diverged at step 212: loss not finite"
    lines = table([row("baseline", 1, 20.0), gone])
    assert lines[1][COLUMNS.index("test BLEU")] == "–"
    assert lines[1][-1] == "diverged at step 212: loss not finite"


def test_a_probe_with_a_newline_or_html_keeps_the_markdown_table_whole() -> None:
    text = markdown_table(["probe", "translation"], [["他\n打我 | <b>x</b>", "a*b `c`"]])
    lines = text.splitlines()
    assert len(lines) == 3  # header, rule, one row
    assert "<b>" not in text and "&lt;b>" in text
    assert lines[2].replace("\\|", "").count("|") == 3  # the row's own bars only


def test_curves_have_distinct_colours_past_ten_runs(tmp_path) -> None:
    runs = []
    for i in range(12):
        run = tmp_path / f"run{i}"
        run.mkdir()
        records = [
            {"step": s, "minutes": s / 10, "loss": 5 - s / 10 - i, "lr": 1e-3} for s in (10, 20)
        ]
        (run / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        runs.append(run)
    from matplotlib.colors import to_hex

    lines = mtrain.curves(*runs).axes[0].get_lines()
    assert len(lines) == 12
    assert len({to_hex(line.get_color()) for line in lines}) == 12  # 10 before: tab10 again


# A small lab, trained once: reported whole, with a run that diverged and one never validated.


@pytest.fixture(scope="module")
def lab_dir(corpus, tmp_path_factory) -> tuple[Lab, Path]:
    out = tmp_path_factory.mktemp("lab") / "lab"
    overrides = [
        *(f"data.{k}={v}" for k, v in corpus.items()),
        "tokenizer.vocab_size=300",
        f"train.eval_every={UPDATES}",
        "train.batch_tokens=512",
        "train.precision=fp32",
    ]
    probes = ("我打他", "他打我", "一二<b>三</b> | 四")  # a lab refuses a newline
    mtrain.lab(
        "configs/tiny.yaml",
        ["no-positions"],
        out,
        updates=UPDATES,
        seeds=(1, 2),
        overrides=overrides,
        probes=probes,
        device="cpu",
    )
    lab = Lab(
        Path("configs/tiny.yaml"),
        Budget(updates=UPDATES),
        (parse_variant("no-positions"),),
        (1, 2),
        tuple(overrides),
        probes,
    )
    return lab, out


def baseline_data(lab_dir: Path):
    """The corpora a lab trained on, as its baseline run recorded them."""
    return run_config(lab_dir / "baseline-seed1").data


def parameters(run_dir: Path) -> int:
    from mtrain.decoding.loaded import open_run

    return sum(p.numel() for p in open_run(run_dir, "cpu").run.model.parameters())


def md_table(text: str, header: str) -> list[list[str]]:
    """The cells of the markdown table whose header line starts with `header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header}"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.replace("\\|", "\x00").strip("|").split("|")])
    return [[c.replace("\x00", "|") for c in r] for i, r in enumerate(rows) if i != 1]


def test_the_report_measures_what_it_compares(lab_dir) -> None:
    lab, out = lab_dir
    rows = report(lab, out, "cpu", {}, baseline_data(out))
    assert [(r.variant, r.seed) for r in rows] == [(r.variant, r.seed) for r in lab.runs()]
    test, dev = eval_set(baseline_data(out), "test"), eval_set(baseline_data(out), "dev")
    assert test.sources != dev.sources
    base = {r.seed: r for r in rows if r.variant == "baseline"}
    for r in rows:
        kept = json.loads((out / "translations" / f"{r.name}.json").read_text("utf-8"))
        assert r.test_bleu == pytest.approx(score(kept["test"], test.references, "en").bleu)
        assert r.dev_bleu == pytest.approx(score(kept["dev"], dev.references, "en").bleu)
        assert (r.best_step, r.updates, r.dropout, r.status) == (UPDATES, UPDATES, 0.1, "")
        assert r.parameters == parameters(r.run_dir)
        assert r.updates_per_s > 0
        if r.variant != "baseline":
            assert r.delta == pytest.approx(r.test_bleu - base[r.seed].test_bleu)
            assert r.p_holm == r.p_value  # one variant: nothing to correct
    first = next(r for r in rows if r.variant != "baseline" and r.seed == 1)
    assert_the_bootstrap_of(first, out, test)  # recomputed
    # The sinusoids no-positions leaves out are a buffer, not parameters (a variant with
    # parameters of its own is counted in test_lab_runs.py's diverging lab).
    assert rows[0].parameters == rows[1].parameters

    text = (out / "report.md").read_text("utf-8")
    cells = md_table(text, "variant | changes")
    assert cells[0] == list(COLUMNS)
    assert [c[COLUMNS.index("seed")] for c in cells[1:]] == ["1", "2", "mean of 2"] * 2
    assert cells[1][COLUMNS.index("test BLEU")] == f"{rows[0].test_bleu:.2f}"
    probes = md_table(text, "variant | 我打他")
    assert probes[0] == ["variant", "我打他", "他打我", "一二&lt;b>三&lt;/b> | 四"]
    assert [p[0] for p in probes[1:]] == ["baseline", "no-positions"]
    page = (out / "report.html").read_text("utf-8")
    assert "<b>三" not in page and "&lt;b&gt;三" in page
    for figure in ("differences.png", "attention.png", "curves.png"):
        assert f'src="{figure}"' in page and f"]({figure})" in text
        assert (out / figure).stat().st_size > 1000


def test_the_test_translations_are_kept(lab_dir, monkeypatch) -> None:
    """A second report translates nothing again: the test set is kept beside the dev set."""
    lab, out = lab_dir
    from mtrain.laboratory import results

    def refuse(*args, **kwargs):
        raise AssertionError("translated again")

    monkeypatch.setattr(results, "open_run", refuse)
    rows = report(lab, out, "cpu", {}, baseline_data(out))
    assert all(r.test_bleu is not None for r in rows)


def test_the_translations_are_made_again_when_what_they_translated_changes(
    lab_dir, tmp_path, monkeypatch
) -> None:
    """The translations kept are those of the dev and test sources as they were: a test set
    resampled at the same size is translated again and scored against its own references, as
    is a run whose kept translations do not say what they translated."""
    lab, out = lab_dir
    work = tmp_path / "lab"
    shutil.copytree(out, work, symlinks=True)
    alone = Lab(lab.config, lab.budget, (), lab.seeds, lab.overrides, lab.probes)
    old = baseline_data(work)
    test_file = tmp_path / "test.tsv"
    test_file.write_text(resampled(Path(old.test).read_text("utf-8")), "utf-8")
    assert test_file.stat().st_size == Path(old.test).stat().st_size
    data = dataclasses.replace(old, test=str(test_file))
    from mtrain.laboratory import results

    translated, open_run = [], results.open_run

    def opened(run_dir, *args, **kwargs):
        translated.append(run_dir.name)
        return open_run(run_dir, *args, **kwargs)

    monkeypatch.setattr(results, "open_run", opened)
    kept_file = {r.name: work / "translations" / f"{r.name}.json" for r in alone.runs()}
    keys = {name: json.loads(path.read_text("utf-8"))["key"] for name, path in kept_file.items()}
    rows = report(alone, work, "cpu", {}, data)
    assert translated == ["baseline-seed1", "baseline-seed2"]
    test = eval_set(data, "test")
    for r in rows:
        kept = json.loads(kept_file[r.name].read_text("utf-8"))
        assert kept["key"] != keys[r.name]
        assert r.test_bleu == pytest.approx(score(kept["test"], test.references, "en").bleu)
    mean = md_table((work / "report.md").read_text("utf-8"), "variant | changes")[-1]
    assert mean[COLUMNS.index("test BLEU")].startswith(f"{sum(r.test_bleu for r in rows) / 2:.2f}")

    translated.clear()
    kept = json.loads(kept_file["baseline-seed1"].read_text("utf-8"))
    del kept["key"]["sources"]  # as a lab kept them before they said what they translated
    kept_file["baseline-seed1"].write_text(json.dumps(kept), "utf-8")
    report(alone, work, "cpu", {}, data)
    assert translated == ["baseline-seed1"]


def test_a_run_that_diverged_or_never_validated_is_a_row(lab_dir, tmp_path) -> None:
    lab, out = lab_dir
    work = tmp_path / "lab"
    shutil.copytree(out, work, symlinks=True)
    (work / "no-positions-seed2" / "best.pt").unlink()
    diverged = {"no-positions-seed1": "diverged at step 7: loss not finite"}
    rows = report(lab, work, "cpu", diverged, baseline_data(work))
    assert [r.name for r in rows] == [r.name for r in lab.runs()]
    gone, unvalidated = rows[1], rows[3]
    assert gone.status == "diverged at step 7: loss not finite"
    assert unvalidated.status.startswith("never validated")
    assert all(r.test_bleu is None and r.delta is None for r in (gone, unvalidated))
    assert gone.updates == UPDATES  # what it trained is still shown
    text = (work / "report.md").read_text("utf-8")
    lines = {c[0] + c[2]: c for c in md_table(text, "variant | changes")[1:]}
    assert lines["no-positions1"][-1] == "diverged at step 7: loss not finite"
    assert lines["no-positions1"][COLUMNS.index("test BLEU")] == "–"
    assert lines["no-positions2"][-1].startswith("never validated")
    assert "differences.png" not in text  # nothing to compare


def test_a_baseline_only_lab_reports_its_seed_noise(lab_dir) -> None:
    lab, out = lab_dir
    alone = Lab(lab.config, lab.budget, (), lab.seeds, lab.overrides, lab.probes)
    rows = report(alone, out, "cpu", {}, baseline_data(out))
    assert [r.name for r in rows] == ["baseline-seed1", "baseline-seed2"]
    text = (out / "report.md").read_text("utf-8")
    mean = md_table(text, "variant | changes")[-1]
    tests = [r.test_bleu for r in rows]
    import statistics

    expected = f"{statistics.mean(tests):.2f} ± {statistics.stdev(tests):.2f}"
    assert mean[COLUMNS.index("test BLEU")] == expected
    assert mean[-1] == f"seed noise: test BLEU {expected} over 2 seeds"
    assert "the baseline alone" in text.splitlines()[0]


def test_the_figure_of_differences_has_a_row_per_variant() -> None:
    from mtrain.figures.lab import Difference, VariantDifferences, draw_differences

    variants = [
        VariantDifferences(
            "one-head",
            [Difference(1, -1.0, -1.5, -0.5, True), Difference(2, -2.0, -2.4, -1.6, True)],
        ),
        VariantDifferences("no-scale", [], "diverged at step 212: loss not finite"),
    ]
    ax = draw_differences(variants).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["one-head", "no-scale"]
    assert "diverged at step 212: loss not finite" in [t.get_text().strip() for t in ax.texts]
    assert not ax.patches  # no mean over seeds: no band


def test_the_figures_band_is_the_verdicts_threshold() -> None:
    """Each variant's grey band is ± the half-width of the interval its mean line's verdict
    reads, drawn from the summaries' own numbers: beyond noise exactly where the mean lies
    outside its band."""
    from mtrain.figures.lab import draw_differences
    from mtrain.laboratory.report import differences

    rows = seeds_lab()
    summed = {s.variant: s for s in summaries(rows)}
    variants = differences(rows)
    means = {v.variant: v.mean for v in variants}
    assert means == {v: summed[v].delta for v in ("worse", "small", "peek", "one-seed")}
    bands = draw_differences(variants).axes[0].patches
    drawn = [v for v in variants if v.mean is not None]
    assert len(bands) == len(drawn) == 3
    for band, v in zip(bands, drawn):
        half = summed[v.variant].delta.half_width
        assert (band.get_x(), band.get_width()) == (pytest.approx(-half), pytest.approx(2 * half))
        outside = abs(v.mean.mean) > half
        assert outside == summed[v.variant].verdict.startswith(("better", "worse"))


def test_the_attention_figures_variant_is_a_named_lab_variant() -> None:
    """The report draws the baseline beside the model variant without positions: a lab can name
    it (renamed or dropped, the figure would have nothing to show)."""
    from mtrain.laboratory.plan import LAB_VARIANTS, NO_POSITIONS

    assert NO_POSITIONS in LAB_VARIANTS


def test_the_attention_shows_the_word_order_probes_or_the_first() -> None:
    from mtrain.laboratory.report import attention_probes

    assert attention_probes(("我是谁", "他打我", "我打他")) == ("我打他", "他打我")
    assert attention_probes(("我是谁", "我打他")) == ("我是谁",)


def test_a_lab_whose_corpora_moved_resumes_and_reports(corpus, tmp_path, monkeypatch, caplog):
    """A moved clone (corpora named relative to it, run from it): a lab stopped mid-run resumes
    that run with its corpora where they now lie (last.pt knows them by their contents), and the
    report reads them there, not where the run's config.yaml first recorded them."""
    clone, moved = tmp_path / "clone", tmp_path / "moved"
    clone.mkdir()
    for key in ("train", "dev", "test"):
        shutil.copy(corpus[key], clone / f"{key}.tsv")
    keys = [f"data.{k}={k}.tsv" for k in ("train", "dev", "test")]
    keys += ["tokenizer.vocab_size=300", f"train.eval_every={UPDATES // 2}"]
    keys += ["train.batch_tokens=512", "train.precision=fp32"]
    config, out = REPO / "configs" / "tiny.yaml", tmp_path / "lab"
    last = out / "baseline-seed1" / LAST

    # SIGTERM once the run's first checkpoint is written, as a stopped lab's Ctrl-C.
    save_last = Checkpoints.save_last

    def stop_after_saving(self, state) -> None:
        save_last(self, state)
        if state["step"] == UPDATES // 2:
            signal.raise_signal(signal.SIGTERM)  # its handler runs before this returns

    monkeypatch.setattr(Checkpoints, "save_last", stop_after_saving)
    monkeypatch.chdir(clone)
    with pytest.raises(Interrupted):
        mtrain.lab(config, [], out, updates=UPDATES, overrides=keys, device="cpu")
    monkeypatch.undo()
    assert peek_checkpoint(last)["step"] < UPDATES and finished_record(last) is None
    assert run_config(out / "baseline-seed1").data.test == str(clone / "test.tsv")

    clone.rename(moved)
    monkeypatch.chdir(moved)
    caplog.set_level("INFO")
    rows = mtrain.lab(config, [], out, updates=UPDATES, overrides=keys, device="cpu")
    assert f"run 1 of 1: baseline-seed1 (the baseline; {UPDATES} updates): resuming" in caplog.text
    assert peek_checkpoint(last)["step"] == UPDATES and finished_record(last) is not None
    assert rows[0].test_bleu is not None
