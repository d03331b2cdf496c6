"""A lab's report: report.md and report.html (what each column means, the table with the
verdicts, the probes' translations, the figures), differences.png (each variant against the
baseline, with its interval), attention.png (what positions do) and curves.png (every run)."""

from __future__ import annotations

import html
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mtrain.core import jsonl
from mtrain.core.config import DataConfig
from mtrain.core.files import write_atomic
from mtrain.core.significance import ALPHA, SAMPLES, MeanDifference, tail_count
from mtrain.decoding.loaded import open_run
from mtrain.figures.attention import Attention
from mtrain.figures.common import cjk_font_path, save
from mtrain.figures.curves import draw_curves
from mtrain.figures.lab import (
    Difference,
    VariantDifferences,
    draw_cross_attention,
    draw_differences,
)
from mtrain.laboratory.plan import BASELINE, NO_POSITIONS, WORD_ORDER, Lab
from mtrain.laboratory.results import (
    LabRow,
    Summary,
    Translations,
    measure,
    run_verdict,
    summaries,
)
from mtrain.run.directory import BEST, METRICS, TRAIN_LOG

LOGS = (METRICS, TRAIN_LOG)
log = logging.getLogger("mtrain")

COLUMNS = (
    "variant",
    "changes",
    "seed",
    "parameters",
    "dropout",
    "updates/s",
    "best step",
    "last step",
    "minutes",
    "dev BLEU",
    "test BLEU",
    "Δ test BLEU [95% interval]",
    "p (Holm)",
    "verdict",
)
SEED = COLUMNS.index("seed")
EXPLAINED = (
    ("variant, changes", "the run's variant and the config changes that make it from the "
     "baseline; every other setting, the budget and the recipe included, is the baseline's."),
    ("seed", "the training seed (initialisation, batch order, dropout). With several seeds a "
     "line \"mean of k\" sums each variant up over them."),
    ("parameters", "counted in the run's checkpoint; a tied embedding counts once."),
    ("dropout", "model.dropout as the run trained: the same in every run, or the comparison "
     "is not fair."),
    ("updates/s", "training speed: the median rate between training log records, so "
     "validations and the start do not count."),
    ("best step, last step", "the step of best.pt (the validation with the best dev BLEU) "
     "and of last.pt (the updates trained)."),
    ("minutes", "from the start of training to its end, validations included."),
    ("dev BLEU", "best.pt's greedy translation of the dev set. The dev set chose best.pt, so "
     "this number flatters it: read test BLEU."),
    ("test BLEU", "best.pt's greedy translation of the test set (the config's data.test), "
     "each source once with all its references; sacreBLEU. Mean lines: mean ± sd over seeds."),
    ("Δ test BLEU [95% interval]", "test BLEU minus the baseline's of the same seed, with "
     f"its 95% interval by the paired bootstrap: {SAMPLES:,} resamples of the test set's "
     "sentences (drawn with replacement, as many as the set holds), drawn once and the same "
     "for every run and seed, each scored for both runs; the interval leaves out the "
     f"{tail_count(SAMPLES)} lowest and the {tail_count(SAMPLES)} highest of the {SAMPLES:,} "
     "differences. It is how far the difference moves with the sentences drawn, not with the "
     "seed. Mean lines: the mean of the k per-seed differences, with its 95% interval, mean ± "
     "t × √(2s²/k + b): s² the variance of a run's test BLEU from seed to seed, pooled over "
     "the lab's systems (each about its own mean), b the variance over the resamples of the "
     "mean of the k resampled differences (the test set's noise), t Student's for the "
     "degrees of freedom of s² (more where b outweighs 2s²/k: Welch-Satterthwaite)."),
    ("p (Holm)", "the paired bootstrap's two-sided p-value: twice (m + 1) / "
     f"({SAMPLES:,} + 1), m the resampled differences on the far side of 0, adjusted by "
     "Holm's method for the variants compared with the same baseline; the raw p-value in "
     f"brackets where it differs. The raw p is below {ALPHA:g} exactly where the interval "
     f"leaves out 0; the adjusted one below {ALPHA:g}: significant. Mean lines: none (their "
     "verdict is their interval's)."),
)  # fmt: skip
ONE_SEED_VERDICT = (
    'from the paired bootstrap: "better (or worse) by x BLEU, significant" where the '
    f"Holm-adjusted p-value is below {ALPHA:g} (its interval then leaves out 0), else "
    "\"within test-set noise\". It covers the test set's sampling, not the seed's luck: train "
    "two or more seeds (--seeds 1,2) to measure that."
)
SEEDS_VERDICT = (
    "a run's line: its own bootstrap, as with one seed. A mean line: \"better (or worse) by x "
    'BLEU" where its 95% interval leaves out 0, else "within noise". On two seeds such a '
    'verdict says "a first sign": s² then rests on one difference per system and on every '
    "system's seeds scattering alike (a system that translates nothing is left out of s²). "
    "Each mean line is judged on its own, with no correction for the number of variants: of "
    "variants that change nothing, at most about one in twenty is called better or worse. The "
    "baseline's mean line is the noise floor: its own spread over seeds, and s with its "
    "degrees of freedom."
)
POSITIONS_TEXT = (
    "Without positions the encoder sees each piece without its place: its attention follows a "
    "piece wherever it stands, and it can tell 我打他 from 他打我 only where the two are cut "
    "into different pieces (SentencePiece marks a word's first piece: ▁我 is not 我). Compare "
    "the pieces under each map, and the two rows' translations."
)
CURVES, DIFFERENCES, ATTENTION = "curves.png", "differences.png", "attention.png"


@dataclass
class Report:
    """What the lab measured, ready to write."""

    rows: list[LabRow]
    translations: dict[str, Translations]  # by run name
    probes: tuple[str, ...]
    title: str
    intro: str
    figures: dict[str, str]  # file (relative to the lab directory): caption


def report(
    lab: Lab, lab_dir: Path, device: str, diverged: Mapping[str, str], data: DataConfig
) -> list[LabRow]:
    """Measure the lab's runs on the dev and test sets of `data` (the baseline's as checked at
    this start: a moved clone's corpora where they now lie, not where a finished run's
    config.yaml recorded them) and write its report; return its rows, one per run (a run that
    diverged, or has no best.pt, is a row that says so). `diverged`: by run name, how."""
    rows, translations = measure(lab.runs(), lab_dir, lab.probes, device, diverged, data)
    figures = draw_figures(rows, lab_dir, lab.probes, device)
    result = Report(rows, translations, lab.probes, title(lab), intro(lab, rows), figures)
    log.info("report: %s, %s", write_markdown(result, lab_dir), write_html(result, lab_dir))
    return rows


def title(lab: Lab) -> str:
    variants = len(lab.variants)
    what = "the baseline alone" if not variants else f"{variants} variant{'s' * (variants > 1)}"
    return f"Lab: {lab.config}, {what}, {lab.budget} per run"


def seeds_text(seeds: list[int]) -> str:
    return f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {', '.join(map(str, seeds))}"


def intro(lab: Lab, rows: list[LabRow]) -> str:
    """What was trained, and what is compared with what."""
    variants = len(lab.variants)
    others = f" and {variants} variant{'s' * (variants > 1)}" if variants else ""
    trained = (
        f"{len(rows)} runs: the baseline ({lab.config}){others}, each trained for "
        f"{lab.budget} with {seeds_text(list(lab.seeds))}."
    )
    if not variants:
        return f"{trained} No variant: the lab measures the baseline's seed noise."
    return (
        f"{trained} Each variant is compared with the baseline of its seed on the test set; "
        f"{variants} variant{'s are' if variants > 1 else ' is'} compared, and on each seed "
        f"Holm's correction over the {variants} keeps the chance that any variant that changes "
        f"nothing is called significant below {ALPHA:g}."
    )


def number(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def interval_text(row: LabRow) -> str:
    if row.delta is None:
        return "–" if row.variant != BASELINE or row.status else "(baseline)"
    low, high = row.interval or (None, None)
    return f"{row.delta:+.2f} [{number(low)}, {number(high)}]"


def p_text(row: LabRow) -> str:
    if row.p_holm is None or row.p_value is None:
        return "–"
    if f"{row.p_holm:.3f}" == f"{row.p_value:.3f}":
        return f"{row.p_holm:.3f}"
    return f"{row.p_holm:.3f} ({row.p_value:.3f})"


def run_line(row: LabRow) -> list[str]:
    return [
        row.variant,
        " ".join(row.changes) or "–",
        str(row.seed),
        "–" if row.parameters is None else f"{row.parameters:,}",
        number(row.dropout, 2),
        number(row.updates_per_s, 1),
        "–" if row.best_step is None else str(row.best_step),
        "–" if row.updates is None else str(row.updates),
        number(row.minutes, 1),
        number(row.dev_bleu),
        number(row.test_bleu),
        interval_text(row),
        p_text(row),
        run_verdict(row),
    ]


def spread_text(spread) -> str:
    if spread is None:
        return "–"
    sd = "" if spread.sd is None else f" ± {spread.sd:.2f}"
    return f"{spread.mean:.2f}{sd}"


def mean_text(delta: MeanDifference | None) -> str:
    """The mean difference over seeds and its 95% interval, as a run's line shows its own."""
    return "–" if delta is None else f"{delta.mean:+.2f} [{delta.low:.2f}, {delta.high:.2f}]"


def mean_line(summary: Summary) -> list[str]:
    """A variant over its seeds: means, spreads, the mean difference and the verdict on it."""
    rows = summary.rows
    measured = [r for r in rows if not r.status]
    known = [r.updates_per_s for r in rows if r.updates_per_s is not None]
    return [
        summary.variant,
        " ".join(rows[0].changes) or "–",
        f"mean of {len(measured)}",
        run_line(rows[0])[COLUMNS.index("parameters")],
        ", ".join(sorted({number(r.dropout, 2) for r in rows})),
        number(sum(known) / len(known), 1) if known else "–",
        "–",
        "–",
        number(sum(r.minutes for r in rows) / len(rows), 1),
        spread_text(summary.dev),
        spread_text(summary.test),
        mean_text(summary.delta),
        "–",
        summary.verdict,
    ]


def table(rows: list[LabRow]) -> list[list[str]]:
    """A line per run; with several seeds, the runs grouped by variant, each group followed
    by its mean line ("mean of k" in the seed column)."""
    if len({r.seed for r in rows}) < 2:
        return [run_line(r) for r in rows]
    lines = []
    for summary in summaries(rows):
        lines += [run_line(r) for r in summary.rows]
        lines.append(mean_line(summary))
    return lines


def markdown_text(text: str) -> str:
    """A table cell's text for markdown: on one line, its markup shown as typed (an
    underscore inside a word, as in label_smoothing, is no markup and stays as it is)."""
    lines = text.splitlines()
    if lines != [text]:  # a line break of any kind
        text = " ↵ ".join(line.strip() for line in lines)
    for char, escaped in (("\\", "\\\\"), ("&", "&amp;"), ("<", "&lt;"), ("|", "\\|")):
        text = text.replace(char, escaped)
    text = re.sub(r"([`*]|\](?=\())", r"\\\1", text)
    return re.sub(r"(?<!\w)_|_(?!\w)", r"\\_", text)


def markdown_table(header: tuple[str, ...] | list[str], lines: list[list[str]]) -> str:
    cells = [" | ".join(markdown_text(c) for c in line) for line in [list(header), *lines]]
    rule = "|" + "---|" * len(header)
    return "\n".join([f"| {cells[0]} |", rule, *(f"| {c} |" for c in cells[1:])])


def first_seed_rows(report: Report) -> list[LabRow]:
    first = report.rows[0].seed
    return [r for r in report.rows if r.seed == first]


def probe_lines(report: Report) -> list[list[str]]:
    """A line per variant (of the first seed): its translation of each probe."""
    lines = []
    for row in first_seed_rows(report):
        translated = report.translations.get(row.name)
        cells = [translated.probes.get(p, "–") if translated else "–" for p in report.probes]
        lines.append([row.variant, *cells])
    return lines


def sections(report: Report) -> list[tuple[str, str, object]]:
    """The report's parts in order: (heading, text, a table as (header, lines) or a figure's
    file); a heading ending in ":" names a column, its text explains it."""
    probes = (["variant", *report.probes], probe_lines(report))
    several = len({r.seed for r in report.rows}) > 1
    verdict = ("verdict:", SEEDS_VERDICT if several else ONE_SEED_VERDICT, None)
    parts = [
        ("", report.intro, None),
        ("The table", "", None),
        *((f"{column}:", text, None) for column, text in EXPLAINED),
        verdict,
        ("", "", (COLUMNS, table(report.rows))),
    ]
    if any(r.delta is not None for r in report.rows):
        parts.append(("Differences from the baseline", "", DIFFERENCES))
    seed = report.rows[0].seed
    parts.append(
        ("Probes", f"best.pt's greedy translations, seed {seed}: a variant per line.", probes)
    )
    if ATTENTION in report.figures:
        shown = {r.variant for r in attention_runs(report.rows)}
        text = POSITIONS_TEXT if NO_POSITIONS in shown else ""
        parts.append(("What positions do", text, ATTENTION))
    if CURVES in report.figures:
        parts.append(("Training curves", "", CURVES))
    return parts


def write_markdown(report: Report, lab_dir: Path) -> Path:
    """report.md: the explanations, the table, the probes, the figures."""
    out = [f"# {markdown_text(report.title)}"]
    for heading, text, part in sections(report):
        if heading.endswith(":"):
            out.append(f"**{markdown_text(heading)}** {markdown_text(text)}")
            continue
        if heading:
            out.append(f"## {heading}")
        if text:
            out.append(markdown_text(text))
        if isinstance(part, tuple):
            out.append(markdown_table(*part))
        elif isinstance(part, str):
            out.append(f"![{markdown_text(report.figures[part])}]({part})")
    path = lab_dir / "report.md"
    write_atomic(path, "\n\n".join(out) + "\n")
    return path


def html_table(header, lines: list[list[str]], kind: str, cells=None) -> str:
    """A table; `cells(line)` gives a line's cells as HTML (default: each escaped)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    cells = cells or (lambda line: [html.escape(c) for c in line])
    body = "".join(
        ('<tr class="mean">' if kind == "numbers" and line[SEED].startswith("mean") else "<tr>")
        + "".join(f"<td>{c}</td>" for c in cells(line))
        + "</tr>"
        for line in lines
    )
    table_html = f'<table class="{kind}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody>'
    return f'<div class="scroll">{table_html}</table></div>'


def html_numbers(lines: list[list[str]]) -> str:
    """The table of runs, each variant's changes in small type under its name (the page is
    narrower than the markdown's fourteen columns)."""

    def cells(line: list[str]) -> list[str]:
        variant, changes, *rest = (html.escape(c) for c in line)
        first = variant if changes == "–" else f"{variant}<br><small>{changes}</small>"
        delta = COLUMNS.index("Δ test BLEU [95% interval]") - 2
        rest[delta] = rest[delta].replace(", ", ",&nbsp;")  # an interval on one line
        return [first, *rest]

    return html_table(["variant and changes", *COLUMNS[2:]], lines, "numbers", cells)


STYLE = """body{font-family:"mtrain CJK",system-ui,"DejaVu Sans",sans-serif;margin:1.5em;
line-height:1.4}p{max-width:60em}p.column{margin:.25em 0}
.scroll{overflow-x:auto}table{border-collapse:collapse;margin:1em 0;font-size:80%}
td,th{border:1px solid #bbb;padding:.25em .4em;vertical-align:top}th{background:#eee}
.numbers td{text-align:right;white-space:nowrap}
.numbers td:first-child,.numbers td:last-child{text-align:left}
.numbers td:first-child{white-space:normal;min-width:7em}small{color:#555}
.numbers td:nth-child(2),.numbers td:nth-child(11),.numbers td:nth-child(12){white-space:normal}
.numbers td:last-child{white-space:normal;min-width:13em}
tr.mean td{font-weight:bold;background:#f3f3f3}
.probes td{overflow-wrap:anywhere;min-width:5em;white-space:pre-wrap}
img{max-width:100%;border:1px solid #ddd;margin:.5em 0}"""


def html_body(report: Report) -> str:
    out = [f"<h1>{html.escape(report.title)}</h1>"]
    for heading, text, part in sections(report):
        if heading.endswith(":"):
            out.append(f'<p class="column"><b>{html.escape(heading)}</b> {html.escape(text)}</p>')
            continue
        if heading:
            out.append(f"<h2>{html.escape(heading)}</h2>")
        if text:
            out.append(f"<p>{html.escape(text)}</p>")
        if isinstance(part, tuple):
            header, lines = part
            out.append(html_numbers(lines) if header == COLUMNS else html_table(*part, "probes"))
        elif isinstance(part, str):
            caption = html.escape(report.figures[part])
            out.append(
                f'<figure><img src="{html.escape(part)}" alt="{caption}">'
                f"<figcaption>{caption}</figcaption></figure>"
            )
    return "".join(out)


def cjk_font_face(text: str) -> str:
    """An @font-face of the CJK font the figures use, cut to the characters of `text`, inline:
    the page shows Chinese on a machine without a CJK font, and needs no other file."""
    import base64
    import io

    from fontTools import subset
    from fontTools.ttLib import TTFont

    logging.getLogger("fontTools").setLevel(logging.WARNING)  # its INFO is a line per table
    font = TTFont(str(cjk_font_path()))
    subsetter = subset.Subsetter(subset.Options())
    subsetter.populate(text="".join(sorted({c for c in text if ord(c) > 127})))
    subsetter.subset(font)
    data = io.BytesIO()
    font.save(data)
    encoded = base64.b64encode(data.getvalue()).decode("ascii")
    return f'@font-face{{font-family:"mtrain CJK";src:url(data:font/otf;base64,{encoded})}}'


def write_html(report: Report, lab_dir: Path) -> Path:
    """report.html: what report.md shows, as one page that opens in a browser."""
    body = html_body(report)
    page = (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(report.title)}</title>"
        f"<style>{cjk_font_face(body)}\n{STYLE}</style></head><body>{body}</body></html>\n"
    )
    path = lab_dir / "report.html"
    write_atomic(path, page)
    return path


def draw_figures(
    rows: list[LabRow], lab_dir: Path, probes: tuple[str, ...], device: str
) -> dict[str, str]:
    """The figures there is something to draw for: file name -> caption."""
    figures = {}
    if any(r.delta is not None for r in rows):
        save(draw_differences(differences(rows)), lab_dir / DIFFERENCES)
        figures[DIFFERENCES] = (
            "each variant's test BLEU minus the baseline's, seed by seed, with the paired "
            "bootstrap's 95% interval (a hollow dot: not significant after Holm's correction); "
            "with several seeds, the mean (a diamond, hollow where within noise) with its 95% "
            "interval, and in grey the band it must leave: ± that interval's half-width"
        )
    shown = attention_runs(rows)
    if shown:
        chosen = attention_probes(probes)
        attention = {
            f"{r.variant} (seed {r.seed})": [
                Attention.of_translation(translator(r, device), p) for p in chosen
            ]
            for r in shown
        }
        save(draw_cross_attention(attention), lab_dir / ATTENTION)
        figures[ATTENTION] = (
            "cross-attention (the last decoder layer, the mean of its heads): which source "
            "piece each output piece looks at, for each sentence and run"
        )
    # a run that diverged before its first log line has nothing to draw
    logged = [r.run_dir for r in rows if any(jsonl.read(r.run_dir / f) for f in LOGS)]
    if logged:
        save(draw_curves(logged), lab_dir / CURVES)
        figures[CURVES] = "every run's training curves, against updates and against minutes"
    return figures


def differences(rows: list[LabRow]) -> list[VariantDifferences]:
    """Each variant's per-seed differences from the baseline and its mean over them with the
    interval its verdict reads (the table's numbers), for the figure."""
    per_variant = []
    for summary in summaries(rows):
        if summary.variant == BASELINE:
            continue
        seeds = [
            Difference(r.seed, r.delta, *(r.interval or (r.delta, r.delta)), r.significant)
            for r in summary.rows
            if r.delta is not None
        ]
        note = "" if seeds else next((r.status for r in summary.rows if r.status), "no BLEU")
        per_variant.append(VariantDifferences(summary.variant, seeds, note, summary.delta))
    return per_variant


def attention_probes(probes: tuple[str, ...]) -> tuple[str, ...]:
    """WORD_ORDER (我打他 and 他打我: the same characters in another order) where both are
    probes; else the first."""
    return WORD_ORDER if set(WORD_ORDER) <= set(probes) else probes[:1]


def attention_runs(rows: list[LabRow]) -> list[LabRow]:
    """The baseline and NO_POSITIONS (where the lab has it, and both were measured) of the
    first seed that has the most of the two."""
    wanted = (BASELINE, NO_POSITIONS)
    by_seed = [
        [r for r in rows if r.seed == seed and r.variant in wanted and not r.status]
        for seed in dict.fromkeys(r.seed for r in rows)
    ]
    return max(by_seed, key=len, default=[])


def translator(row: LabRow, device: str):
    return open_run(row.run_dir, device, BEST, beam=1).translator
