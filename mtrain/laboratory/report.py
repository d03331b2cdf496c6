"""A lab's report: report.md and report.html (the table, the probes' translations, the
figures), curves.png (every run's training curves) and attention/<variant>.png."""

from __future__ import annotations

import html
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path

from mtrain.core.files import write_atomic
from mtrain.figures.common import cjk_font_path, save
from mtrain.figures.curves import draw_curves
from mtrain.laboratory.plan import BASELINE
from mtrain.laboratory.results import LabRow, Translations

COLUMNS = (
    "variant",
    "seed",
    "updates",
    "minutes",
    "train loss",
    "dev loss",
    "dev BLEU",
    "Δ BLEU",
    "p-value",
)
CURVES = "curves.png"
EXPLAINED = (
    "Updates and minutes: each run's own; train loss: the last logged (label-smoothed); dev "
    "loss: at the last validation; dev BLEU: best.pt's greedy translation of the dev set; "
    "p-value: sacrebleu's paired bootstrap (1000 resamples) against the baseline of the same seed."
)
ATTENTION = "attention"


@dataclass
class Report:
    """What the lab measured, ready to write."""

    rows: list[LabRow]
    translations: dict[str, Translations]  # by run name
    probes: tuple[str, ...]
    title: str
    figures: list[Path]  # relative to the lab directory: curves, then each variant's attention


def number(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def table(rows: list[LabRow]) -> list[list[str]]:
    """One line per run; with several seeds, then one per variant: the means over its seeds."""
    base = {r.seed: r.dev_bleu for r in rows if r.variant == BASELINE}
    lines = [
        [
            r.variant,
            str(r.seed),
            str(r.updates),
            number(r.minutes, 1),
            number(r.train_loss, 3),
            number(r.dev_loss, 3),
            number(r.dev_bleu),
            delta(r.dev_bleu, base.get(r.seed)),
            "(baseline)" if r.variant == BASELINE else number(r.p_value, 4),
        ]
        for r in rows
    ]
    if len(base) < 2:
        return lines
    for variant in dict.fromkeys(r.variant for r in rows):
        mine = [r for r in rows if r.variant == variant]
        mean = {
            k: mean_of([getattr(r, k) for r in mine])
            for k in ("updates", "minutes", "train_loss", "dev_loss", "dev_bleu")
        }
        deltas = [r.dev_bleu - base[r.seed] for r in mine if r.seed in base]
        p_values = ", ".join(number(r.p_value, 4) for r in mine if r.p_value is not None)
        lines.append(
            [
                f"**{variant}** (mean)",
                "all",
                number(mean["updates"], 0),
                number(mean["minutes"], 1),
                number(mean["train_loss"], 3),
                number(mean["dev_loss"], 3),
                number(mean["dev_bleu"]),
                f"{statistics.mean(deltas):+.2f}" if deltas else "–",
                "(baseline)" if variant == BASELINE else p_values or "–",
            ]
        )
    return lines


def mean_of(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.mean(known) if known else None


def delta(bleu: float, base: float | None) -> str:
    return "–" if base is None else f"{bleu - base:+.2f}"


def markdown_table(header: tuple[str, ...] | list[str], lines: list[list[str]]) -> str:
    cells = [" | ".join(c.replace("|", "\\|") for c in line) for line in lines]
    return "\n".join(
        [f"| {' | '.join(header)} |", f"|{'---|' * len(header)}", *(f"| {c} |" for c in cells)]
    )


def probe_lines(report: Report) -> list[list[str]]:
    """A line per probe: its translation by each run of the first seed."""
    first = report.rows[0].seed
    names = [f"{r.variant}-seed{r.seed}" for r in report.rows if r.seed == first]
    return [[p, *(report.translations[n].probes.get(p, "") for n in names)] for p in report.probes]


def probe_header(report: Report) -> list[str]:
    first = report.rows[0].seed
    return ["probe", *(r.variant for r in report.rows if r.seed == first)]


def write_markdown(report: Report, lab_dir: Path) -> Path:
    """report.md: the table, the probes, the figures."""
    text = "\n\n".join(
        [
            f"# {report.title}",
            EXPLAINED,
            markdown_table(COLUMNS, table(report.rows)),
            f"## Probes (seed {report.rows[0].seed})",
            markdown_table(probe_header(report), probe_lines(report)),
            "## Figures",
            *(f"![{caption(f)}]({f.as_posix()})" for f in report.figures),
        ]
    )
    path = lab_dir / "report.md"
    write_atomic(path, text + "\n")
    return path


def caption(figure: Path) -> str:
    if figure == Path(CURVES):
        return "every run's training curves, against updates and against minutes"
    return f"{figure.stem}: cross-attention for the first probe"


def html_table(header: list[str] | tuple[str, ...], lines: list[list[str]], kind: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c.replace('**', ''))}</td>" for c in line) + "</tr>"
        for line in lines
    )
    return f'<table class="{kind}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


STYLE = """body{font-family:"mtrain CJK",system-ui,"DejaVu Sans",sans-serif;margin:2em}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #bbb;padding:.3em .6em}
th{background:#eee}.probes td{overflow-wrap:anywhere;min-width:8em}
.numbers td{text-align:right}.numbers td:first-child{text-align:left}
img{max-width:100%;border:1px solid #ddd;margin:.5em 0}"""


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
    figures = "".join(
        f'<figure><img src="{html.escape(f.as_posix())}" alt="{html.escape(caption(f))}">'
        f"<figcaption>{html.escape(caption(f))}</figcaption></figure>"
        for f in report.figures
    )
    body = (
        f"<h1>{html.escape(report.title)}</h1><p>{html.escape(EXPLAINED)}</p>"
        f"{html_table(COLUMNS, table(report.rows), 'numbers')}"
        f"<h2>Probes (seed {report.rows[0].seed})</h2>"
        f"{html_table(probe_header(report), probe_lines(report), 'probes')}"
        f"<h2>Figures</h2>{figures}"
    )
    page = (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(report.title)}</title>"
        f"<style>{cjk_font_face(body)}\n{STYLE}</style></head><body>{body}</body></html>\n"
    )
    path = lab_dir / "report.html"
    write_atomic(path, page)
    return path


def draw_figures(rows: list[LabRow], lab_dir: Path, attention: dict[str, object]) -> list[Path]:
    """curves.png (every run) and, for each variant of the first seed, its attention figure."""
    save(draw_curves([r.run_dir for r in rows]), lab_dir / CURVES)
    paths = [Path(CURVES)]
    for variant, figure in attention.items():
        path = Path(ATTENTION) / f"{variant}.png"
        save(figure, lab_dir / path)
        paths.append(path)
    return paths
