"""Is one recipe better than another on the dev split, or is the difference noise?

    python scripts/compare_dev.py --system default=runs/A --system greedy=runs/A:beam=1 \
        --system dropout0.3=runs/B [--samples 1000] [--split dev|test]

Each --system is NAME=RUN, optionally followed by `:beam=N`, `:alpha=A` or `:checkpoint=FILE`
(best.pt unless told); the first is the baseline. Every system translates the split named in the
baseline run's config (`data.dev` unless --split test), each source once with all of its
references, and the paired bootstrap (mtrain.core.significance, as `mtrain lab` computes it:
the resamples of the split's sentences drawn once, every system scored on the same ones)
compares each system with the baseline. Prints a Markdown table on stdout: BLEU, the bootstrap
mean with its 95% confidence interval, the difference from the baseline with the 95% interval
of that difference over the same resamples, and its two-sided p-value (below 0.05 exactly where
that interval leaves out 0; uncorrected for the number of systems); progress on stderr.

Every system's run, checkpoint and options are checked before anything translates; an error
is one line `compare_dev.py: error: ...` and exit status 2, as `mtrain`'s. A checkpoint is named
by `:checkpoint=FILE`, not as the run (as `mtrain translate --run` takes a directory only).

Compare training recipes at an equal number of updates, and once per seed: the decision is the
mean over seeds, with each seed's p-value beside it (docs/recipes.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtrain.commands.common import Decoding, Engine, ScriptParser, load_engine, script_main
from mtrain.core.errors import MtrainError, OptionError
from mtrain.core.significance import paired_bootstrap, tail_count
from mtrain.data.corpus import corpora, read_pairs
from mtrain.data.pairs import group_references
from mtrain.decoding.loaded import decode_options
from mtrain.export.converter import is_export
from mtrain.run.directory import BEST, peek_checkpoint, resolve, run_config

OPTIONS = {"beam": int, "alpha": float, "checkpoint": str}


def parse_system(text: str) -> tuple[str, Path, dict]:
    """NAME=RUN[:beam=N][:alpha=A][:checkpoint=FILE] -> (name, run, options)."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=RUN[:key=value...]")
    run, *pairs = rest.split(":")
    options = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in OPTIONS:
            raise argparse.ArgumentTypeError(f"{text!r}: {key!r} is not one of {list(OPTIONS)}")
        try:
            options[key] = OPTIONS[key](value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {key}={value!r} is not a number") from None
    return name, Path(run), options


def check_system(name: str, run: Path, options: dict) -> None:
    """Refuse a system whose run, checkpoint or decoding options cannot be used, before
    anything translates: as `mtrain translate` refuses them, naming the system."""
    where = f"--system {name}={run}"
    if run.is_file():
        raise OptionError(
            f"{where}: a file, not a run directory (a checkpoint is named as RUN:checkpoint=FILE)"
        )
    if is_export(run):
        raise OptionError(
            f"{where}: a CTranslate2 export (written by mtrain export), not a run directory; "
            "compare the run it was exported from"
        )
    try:
        decode_options(run_config(run), options.get("beam"), options.get("alpha"), 1)
        peek_checkpoint(resolve(run, options.get("checkpoint", BEST)))
    except MtrainError as e:
        raise OptionError(f"{where}: {e}") from None


def translate(run: Path, sources: list[str], options: dict) -> list[str]:
    """Best translations of `sources` by the run's model with these decoding options."""
    decoding = Decoding(
        run,
        "cpu",
        checkpoint=options.get("checkpoint", BEST),
        beam=options.get("beam"),
        alpha=options.get("alpha"),
    )
    _, _, translator = load_engine(Engine.mtrain, decoding)
    return [t[0].text for t in translator.stream(sources)]


def main() -> None:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", type=parse_system, action="append", required=True)
    parser.add_argument("--split", choices=["dev", "test"], default="dev")
    parser.add_argument("--samples", type=int, default=1000, help="bootstrap resamples")
    args = parser.parse_args()
    if len(args.system) < 2:
        parser.error("name at least two systems: the baseline, then the others")
    if args.samples < 1:
        parser.error(f"argument --samples: expected 1 or more, got {args.samples}")
    try:
        tail_count(args.samples)  # enough resamples for a p-value below 0.05
    except ValueError as e:
        parser.error(f"argument --samples: {e}")
    for system in args.system:
        check_system(*system)

    data = run_config(args.system[0][1]).data
    (corpus,) = corpora(getattr(data, args.split), data.swap_columns)
    sources, references = group_references(
        read_pairs(corpus, data.src_lang, data.tgt_lang, scored=True)
    )
    print(f"{corpus.path}: {len(sources)} sources", file=sys.stderr)
    named = []
    for name, run, options in args.system:
        print(f"translating with {name} ({run}, {options or 'its own options'})", file=sys.stderr)
        named.append((name, translate(run, sources, options)))

    compared = paired_bootstrap(named, references, data.tgt_lang, args.samples)
    signature = compared[0].signature
    print(f"{corpus.path}, {len(sources)} sources; {args.samples} resamples; {signature}")
    print()
    print("| system | BLEU | bootstrap mean ± 95% CI | difference [95% interval] | p-value |")
    print("|---|---|---|---|---|")
    base = compared[0].bleu
    for result in compared:
        p = "(baseline)" if result.p_value is None else f"{result.p_value:.4f}"
        difference = f"{result.bleu - base:+.2f}"
        if result.low is not None:
            difference += f" [{result.low:+.2f}, {result.high:+.2f}]"
        print(
            f"| {result.name} | {result.bleu:.2f} | {result.mean:.2f} ± {result.ci:.2f} "
            f"| {difference} | {p} |"
        )


if __name__ == "__main__":
    script_main(main)
