"""What building on a run (`train.init_from`) buys: the two studies of docs/training.md.

    python scripts/finetune_study.py --config configs/default.yaml --out runs/study \
        --minutes 29 --finetune-minutes 5 --seeds 1 2 [--study longer|own|both]

`longer` (train longer): run A for the budget, run B from A's best.pt for the same budget,
one run of twice the budget, and A resumed with twice the budget (refused where A's learning
rate is annealed: the table says so). Each `--restart "KEY=VALUE ..."` adds a run like B with
those settings (a warm-start recipe: `--restart "train.lr=1e-3 train.warmup_steps=100"`).

`own` (your own small corpus): the shipped training pairs whose source names 汤姆 or whose
English names Tom (every translation of such a source with them) are held out as the user's
corpus, split into its own train, dev and test files under OUT/own/data/; the base trains on
the rest; then, per seed, a run from scratch on the slice, the base fine-tuned on it, and the
base fine-tuned on the slice mixed with as many general pairs. Every model is scored on the
slice's test and on the shipped test (what fine-tuning forgets).

A budget is minutes (`--minutes`, `--finetune-minutes`) or updates (`--max-steps`,
`--finetune-max-steps`, which set train.max_minutes=0). Runs go to OUT/<study>/<name>; one
already there is resumed or, finished, left as it is, so a study stopped half-way goes on
where it stopped. Prints Markdown tables on stdout; the runs' progress goes to stderr.

The options, every run's settings and the slice are checked before anything trains: an error is
one line `finetune_study.py: error: ...` and exit status 2, as `mtrain`'s. A run that fails (or
is not run, its parent having failed) is a row saying why, and the study then exits with status
1; A resumed, refused because A's learning rate is annealed, is a result, not a failure.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from mtrain.commands import common
from mtrain.core import config
from mtrain.core.errors import MtrainError, OptionError
from mtrain.core.significance import paired_bootstrap
from mtrain.data.corpus import corpora, read_pairs
from mtrain.data.pairs import group_references, read_lines
from mtrain.run.directory import (
    LAST,
    load_checkpoint,
    peek_checkpoint,
    run_config,
    training_summary,
)
from mtrain.training.coordinator import Finished

SLICE_TARGET = r"\bTom\b"
SLICE_SOURCE = "汤姆|湯姆"


def pattern(text: str) -> str:
    """A regular expression, checked as the option is read."""
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"{text!r}: not a regular expression ({e})") from None
    return text


def heldout_share(text: str) -> float:
    """The share of the slice held out for dev, and as much for test: leaves some to train."""
    share = float(text)
    if not 0 < share < 0.5:
        raise argparse.ArgumentTypeError(
            f"{text}: expected a share above 0 and below 0.5 (dev and test take one each)"
        )
    return share


def positive(text: str) -> int:
    number = int(text)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{text}: expected 1 or more")
    return number


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/default.yaml"))
    parser.add_argument("--out", type=Path, default=Path("runs/finetune-study"))
    parser.add_argument("--study", choices=["longer", "own", "both"], default="both")
    parser.add_argument("--minutes", type=float, help="each base run's budget (default: config)")
    parser.add_argument("--max-steps", type=int, help="each base run's budget in updates")
    parser.add_argument("--finetune-minutes", type=float, default=5.0)
    parser.add_argument("--finetune-max-steps", type=int, help="instead of --finetune-minutes")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="of the short runs")
    parser.add_argument(
        "--restart",
        action="append",
        default=[],
        metavar="'KEY=VALUE ...'",
        help="a run like B from A's best.pt with these settings (repeatable)",
    )
    parser.add_argument(
        "--slice-target", type=pattern, default=SLICE_TARGET, help="regex on the English"
    )
    parser.add_argument(
        "--slice-source", type=pattern, default=SLICE_SOURCE, help="regex on the source"
    )
    parser.add_argument(
        "--slice-heldout", type=heldout_share, default=0.1, help="share for dev, and for test"
    )
    parser.add_argument(
        "--mix-pairs", type=positive, help="general pairs mixed in (default: the slice's)"
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="for every run"
    )
    return parser.parse_args(argv)


def budget(minutes: float | None, steps: int | None, factor: int = 1) -> list[str]:
    """The --set values of a budget, `factor` times over."""
    if steps is not None:
        return [f"train.max_steps={steps * factor}", "train.max_minutes=0"]
    return [] if minutes is None else [f"train.max_minutes={minutes * factor}"]


def check_settings(args: argparse.Namespace) -> None:
    """Refuse, before anything trains, settings that would refuse a run of the study."""
    base = budget(args.minutes, args.max_steps)
    finetune = budget(args.finetune_minutes, args.finetune_max_steps)
    runs = [("--minutes/--max-steps", base), ("--finetune-minutes/--finetune-max-steps", finetune)]
    runs += [(f"--restart {recipe!r}", [*base, *recipe.split()]) for recipe in args.restart]
    runs += [(f"--seeds {seed}", [f"train.seed={seed}"]) for seed in args.seeds]
    for option, settings in runs:
        try:
            config.load(args.config, [*args.overrides, *settings])
        except config.ConfigError as e:
            raise OptionError(f"{option}: {e}") from None
    if args.out.exists() and not args.out.is_dir():
        raise OptionError(f"--out {args.out}: exists and is not a directory")


def annealed(run: Path) -> bool:
    """Whether `run` finished with its learning rate annealed, so that resuming it with a
    raised budget is refused (what the study shows, not a failure)."""
    try:
        finished = peek_checkpoint(run / LAST).get("finished")
        cfg = run_config(run)
    except MtrainError:  # the refusal was another one
        return False
    return finished is not None and Finished.from_dict(finished).annealed(cfg.train)


class Study:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.cfg = config.load(args.config, args.overrides)
        check_settings(args)
        self.failed = 0  # rows whose run failed, was not run, or could not be scored
        self.tests: dict[str, list[Path]] = {}  # each study's test sets, written before it trains
        if args.study in ("own", "both"):
            data = args.out / "own" / "data"
            self.slice = split_slice(self.cfg, data, args)
            slice_test = test_files(str(self.slice["test"]), self.cfg, data / "slice-test")
            self.tests["own"] = [
                slice_test,
                test_files(self.cfg.data.test, self.cfg, data / "general-test"),
            ]
        if args.study in ("longer", "both"):
            test = test_files(self.cfg.data.test, self.cfg, args.out / "longer" / "data" / "test")
            self.tests["longer"] = [test]

    def train(self, out: Path, settings: list[str], init_from: Path | None = None) -> str | None:
        """Train (or resume) `out`; None, or the error line of a refused or failed run."""
        command = [sys.executable, "-m", "mtrain", "train", "--config", str(self.args.config)]
        command += ["--out", str(out)]
        command += [f"--set={s}" for s in [*self.args.overrides, *settings]]
        if init_from is not None:
            command += ["--init-from", str(init_from)]
        print(f"# {' '.join(command)}", file=sys.stderr, flush=True)
        done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        sys.stderr.write(done.stderr[-2000:])
        if done.returncode == 0:
            return None
        errors = [line for line in done.stderr.splitlines() if line.startswith("mtrain: error")]
        return errors[-1] if errors else f"exit status {done.returncode}"

    @functools.cache  # noqa: B019 (one Study a process)
    def translate(self, run: Path, test: Path) -> Hypotheses | None:
        """`run`'s best.pt on the grouped test set `test` (test_files writes it): its test BLEU
        and its translations, one a line."""
        refs = sorted(test.parent.glob(f"{test.name}.ref*"))
        command = [sys.executable, "-m", "mtrain", "eval", "--run", str(run), "--json"]
        command += ["--src", f"{test}.src", *(f"--ref={ref}" for ref in refs)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            sys.stderr.write(done.stderr[-2000:])
            return None
        result = json.loads(done.stdout)
        return Hypotheses(result["bleu"], read_lines(Path(result["hypotheses"])))

    def row(
        self,
        name: str,
        run: Path,
        tests: list[Path],
        error: str | None,
        base: list[Hypotheses | None] | None = None,
        refused: bool = False,
    ) -> list[str]:
        """A table row: name, updates, minutes, best dev BLEU, and each test's BLEU; with
        `base` (the base run's translations of each test), each test's difference from the
        base with its 95% paired-bootstrap interval. A row whose run failed counts in
        `failed` unless its refusal is the result (`refused`)."""
        n_cells = 2 + len(tests) * (1 if base is None else 2)
        if error is not None or not (run / LAST).exists():
            self.failed += not refused
            return [name, error or "no run", *[""] * n_cells]
        summary = training_summary(run)
        step = load_checkpoint(run / LAST)["step"]
        dev = summary["best_dev_bleu"]
        cells = [name, f"{step:,}", f"{summary['minutes']:.1f}"]
        cells.append("" if dev is None else f"{dev:.2f}")
        for k, test in enumerate(tests):
            ours = self.translate(run, test)
            self.failed += ours is None
            cells.append("failed" if ours is None else f"{ours.bleu:.2f}")
            if base is not None:
                cells.append(difference(base[k], ours, test, self.cfg.data.tgt_lang))
        return cells

    def longer(self) -> list[list[str]]:
        """Study (a): A, B from A, twice the budget, A resumed with twice the budget."""
        a = self.args
        root, base = a.out / "longer", budget(a.minutes, a.max_steps)
        double = budget(a.minutes, a.max_steps, 2) or [
            f"train.max_minutes={self.cfg.train.max_minutes * 2}"
        ]
        (test,) = self.tests["longer"]
        first = self.train(root / "A", base)
        rows = [self.row("A (one budget)", root / "A", [test], first)]
        for settings in [[], *(recipe.split() for recipe in a.restart)]:  # B, then each --restart
            out = root / "-".join(["B", *(re.sub(r"[^\w.=-]", "_", s) for s in settings)])
            name = "B from A's best.pt" + (f", {' '.join(settings)}" if settings else " (one more)")
            error = first or self.train(out, [*base, *settings], root / "A")
            rows.append(self.row(name, out, [test], error))
        error = self.train(root / "double", double)
        rows.append(self.row("one run, twice the budget", root / "double", [test], error))
        resumed = root / "A-resumed"
        if first is None and not resumed.exists():
            shutil.copytree(root / "A", resumed)
        error = first or self.train(resumed, double)
        refused = first is None and error is not None and annealed(root / "A")
        rows.append(self.row("A resumed, twice the budget", resumed, [test], error, None, refused))
        return rows

    def own(self) -> list[list[str]]:
        """Study (b): the base on the rest; scratch, fine-tuned and mixed runs on the slice."""
        a = self.args
        root, files, tests = a.out / "own", self.slice, self.tests["own"]
        base = root / "base"
        error = self.train(base, [f"data.train={files['rest']}", *budget(a.minutes, a.max_steps)])
        scored = [None if error else self.translate(base, test) for test in tests]
        rows = [self.row("base (general pairs only)", base, tests, error, [None] * len(tests))]
        short = budget(a.finetune_minutes, a.finetune_max_steps)
        on_slice = [f"data.train={files['train']}", f"data.dev={files['dev']}"]
        on_slice += [f"data.test={files['test']}"]
        mixed = f"data.train=[{files['train']}, {files['mix']}]"
        for seed in a.seeds:
            runs = [
                ("scratch on the slice", "scratch", on_slice, None),
                ("base fine-tuned on the slice", "finetuned", on_slice, base),
                ("base fine-tuned, slice + general", "mixed", [*on_slice, mixed], base),
            ]
            for name, directory, data, parent in runs:
                out = root / f"{directory}-seed{seed}"
                settings = [*data, *short, f"train.seed={seed}"]
                failed = error if parent is not None else None
                failed = failed or self.train(out, settings, parent)
                rows.append(self.row(f"{name} (seed {seed})", out, tests, failed, scored))
        return rows


@dataclass
class Hypotheses:
    bleu: float
    lines: list[str]


def difference(base: Hypotheses | None, ours: Hypotheses | None, test: Path, tgt_lang: str) -> str:
    """`ours` BLEU minus the base's on `test`, and the 95% interval of that difference over
    the paired bootstrap's resamples (mtrain.core.significance, as `mtrain lab` computes it)."""
    if base is None or ours is None:
        return ""
    streams = [read_lines(ref) for ref in sorted(test.parent.glob(f"{test.name}.ref*"))]
    references = [[r for r in refs if r.strip()] for refs in zip(*streams)]
    _, compared = paired_bootstrap(
        [("base", base.lines), ("run", ours.lines)], references, tgt_lang
    )
    return f"{compared.bleu - base.bleu:+.2f} [{compared.low:+.2f}, {compared.high:+.2f}]"


def test_files(test: str | dict, cfg: config.Config, stem: Path) -> Path:
    """Write a test corpus as STEM.src and STEM.ref0, .ref1...: each source once with all its
    references (as `mtrain eval` scores a run's own test split); return STEM."""
    (corpus,) = corpora(test, cfg.data.swap_columns)
    sources, references = group_references(
        read_pairs(corpus, cfg.data.src_lang, cfg.data.tgt_lang, scored=True)
    )
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.src").write_text("".join(s + "\n" for s in sources), encoding="utf-8")
    for old in stem.parent.glob(f"{stem.name}.ref*"):
        old.unlink()
    for k in range(max(len(refs) for refs in references)):
        lines = "".join((refs[k] if k < len(refs) else "") + "\n" for refs in references)
        Path(f"{stem}.ref{k}").write_text(lines, encoding="utf-8")
    return stem


def split_slice(cfg: config.Config, out: Path, args: argparse.Namespace) -> dict[str, Path]:
    """Split the (single, TSV) training corpus into the slice's train, dev and test and the
    rest, whole sources at a time (every translation of a source goes to one side); write them
    into `out`, and `mix`: as many random pairs of the rest as the slice's train holds."""
    (train,) = corpora(cfg.data.train, cfg.data.swap_columns)
    lines = train.path.read_text(encoding="utf-8").splitlines(keepends=True)
    target, source = re.compile(args.slice_target), re.compile(args.slice_source)
    by_source: dict[str, list[str]] = {}
    for line in lines:
        columns = line.rstrip("\n").split("\t")  # Tatoeba's 4 columns, or source<TAB>target
        src, tgt = (columns[1], columns[3]) if len(columns) == 4 else columns[:2]
        if cfg.data.swap_columns:
            src, tgt = tgt, src
        by_source.setdefault(src, []).append((line, tgt))
    chosen, rest = [], []
    for src, group in by_source.items():
        if source.search(src) or any(target.search(tgt) for _, tgt in group):
            chosen.append([line for line, _ in group])
        else:
            rest += [line for line, _ in group]
    random.Random(1).shuffle(chosen)
    n_heldout = max(1, round(len(chosen) * args.slice_heldout))
    parts = {
        "test": chosen[:n_heldout],
        "dev": chosen[n_heldout : 2 * n_heldout],
        "train": chosen[2 * n_heldout :],
    }
    counts = {name: sum(len(g) for g in groups) for name, groups in parts.items()}
    if empty := [name for name in parts if not counts[name]]:
        raise OptionError(
            f"--slice-target {args.slice_target!r}, --slice-source {args.slice_source!r}, "
            f"--slice-heldout {args.slice_heldout}: the slice's {len(chosen)} sources leave "
            f"its {' and '.join(empty)} no pairs"
        )
    n_mix = args.mix_pairs or counts["train"]
    if n_mix > len(rest):
        raise OptionError(f"--mix-pairs {n_mix}: more than the {len(rest)} general pairs")
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, groups in parts.items():
        paths[name] = out / f"slice-{name}.tsv"
        paths[name].write_text("".join(line for g in groups for line in g), encoding="utf-8")
    paths["rest"] = out / "general-train.tsv"
    paths["rest"].write_text("".join(rest), encoding="utf-8")
    paths["mix"] = out / "general-mix.tsv"
    paths["mix"].write_text("".join(random.Random(2).sample(rest, n_mix)), encoding="utf-8")
    print(
        f"# slice: {counts['train']} train, {counts['dev']} dev, {counts['test']} test pairs; "
        f"{len(rest)} general pairs, {n_mix} mixed in",
        file=sys.stderr,
    )
    return paths


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main(argv: list[str] | None = None) -> int:
    """Run the studies asked for; the exit status: 1 where a row's run failed."""
    args = parse_args(argv)
    study = Study(args)
    columns = ["run", "updates", "minutes", "best dev BLEU"]
    if args.study in ("longer", "both"):
        print(table([*columns, "test BLEU"], study.longer()))
        print()
    if args.study in ("own", "both"):
        tests = ["slice test BLEU", "Δ vs base [95%]", "general test BLEU", "Δ vs base [95%]"]
        print(table([*columns, *tests], study.own()))
    if study.failed:
        common.error(f"{study.failed} rows failed (the table says why)", Path(sys.argv[0]).name)
        return 1
    return 0


if __name__ == "__main__":
    common.script_main(main)
