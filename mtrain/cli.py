"""The `mtrain` command line: parse arguments, call the library, print results on stdout."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import os
import signal
import sys
import textwrap
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer
import yaml
from tqdm import tqdm

from mtrain import checkpoint, config, runtime
from mtrain.attention import AttentionRecorder, save_figures
from mtrain.checkpoint import CheckpointError
from mtrain.config import Config, ConfigError
from mtrain.data import DataError, decode_lines, group_references, read_lines, read_parallel
from mtrain.distributed import DistributedError
from mtrain.evaluate import score
from mtrain.figures import FigureError
from mtrain.files import (
    LOCK_FILE,
    DirectoryLock,
    DirectoryLocked,
    atomic_open,
    remove_leftovers,
    write_atomic,
)
from mtrain.runtime import DeviceError
from mtrain.tokenizer import BOS_ID, EOS_ID
from mtrain.trace import Tracer, format_trace
from mtrain.translate import Translation, Translator

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Train Transformer translation models and translate with them.",
)
plot_app = typer.Typer(
    no_args_is_help=True,
    help="Draw PNG figures: training curves, the positional encoding, the attention masks.",
)
app.add_typer(plot_app, name="plot")
RUNS_ROOT = Path("runs")
log = logging.getLogger("mtrain")


class Quantize(str, enum.Enum):
    none = "none"
    int8 = "int8"


RunOption = Annotated[
    Path | None,
    typer.Option(
        "--run",
        help="Run directory to use. Default: the most recently trained run under ./runs/.",
        file_okay=False,
    ),
]


BeamOption = Annotated[
    int | None, typer.Option("--beam", min=1, help="Beam size; 1 is greedy. Default: the run's.")
]
AlphaOption = Annotated[
    float | None,
    typer.Option(min=0.0, help="Length penalty exponent for beam search. Default: the run's."),
]
QuantizeOption = Annotated[
    Quantize,
    typer.Option(help="int8: dynamic int8 quantization of the linear layers (CPU only)."),
]
DeviceOption = Annotated[str, typer.Option(help="auto (CUDA when present), cpu or cuda.")]
CheckpointOption = Annotated[
    str,
    typer.Option(
        "--checkpoint",
        help="Checkpoint in the run directory: best.pt, last.pt, averaged.pt or step-N.pt.",
    ),
]


# Errors of the user's making (input, files, config, devices): one line each, exit status 2.
USER_ERRORS = (
    ConfigError,
    DataError,
    CheckpointError,
    DeviceError,
    DirectoryLocked,
    DistributedError,
    FigureError,
)


def fail(message: str) -> None:
    typer.echo(f"mtrain: error: {message}", err=True)
    raise typer.Exit(2)


def main(argv: list[str] | None = None) -> None:
    """The `mtrain` console script: every error is one line on stderr and a non-zero status."""
    try:
        status = app(argv, prog_name="mtrain", standalone_mode=False)
    except USER_ERRORS as e:
        status = error(str(e))
    except OSError as e:  # a file that cannot be read or written
        status = error(f"{e.filename}: {e.strerror}" if e.filename else str(e))
    except Exception as e:
        if not hasattr(e, "format_message"):  # not a command-line usage error: a bug
            raise
        message = e.format_message()  # a bad option or argument, from the parser
        if not message:  # `mtrain` alone: the parser printed the help
            sys.exit(2)
        command = getattr(getattr(e, "ctx", None), "command_path", "mtrain")
        status = error(f"{message.rstrip('.')} (see {command} --help)")
    sys.exit(status if isinstance(status, int) else 0)


def error(message: str) -> int:
    typer.echo(f"mtrain: error: {message}", err=True)
    return 2


def setup_logging(quiet: bool = False) -> None:
    """Log to stderr: progress and information, or warnings and errors only when `quiet`."""
    level = logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr)


def resolve_run(run: Path | None) -> Path:
    if run is not None:
        return run
    run = checkpoint.latest_run(RUNS_ROOT)
    log.info("using run %s", run)
    return run


RESUMABLE_KEYS = {"max_steps", "max_minutes"}  # train.* keys a resumed run may change


def is_run_dir(path: Path) -> bool:
    """A directory that mtrain trained into (or began to)."""
    return (path / checkpoint.CONFIG_FILE).is_file() or (path / LOCK_FILE).is_file()


def check_resumable(run_dir: Path, cfg: Config) -> None:
    """Refuse to resume a run with a config other than its own (but for its limits)."""
    saved = config.load(run_dir / checkpoint.CONFIG_FILE).to_dict()
    new = cfg.to_dict()
    for section, values in new.items():
        for key, value in values.items():
            if saved[section][key] != value and not (section == "train" and key in RESUMABLE_KEYS):
                fail(
                    f"{run_dir} was trained with {section}.{key}={saved[section][key]!r}, not "
                    f"{value!r}; use the run's own config or another --out"
                )


@app.command()
def train(
    config_path: Annotated[
        Path, typer.Option("--config", "-c", help="YAML config file, e.g. configs/default.yaml.")
    ],
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set", help="Override one config key, e.g. --set train.lr=3e-4 (repeatable)."
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Run directory. Default: runs/<config name>-<date-time>. If it holds a "
            "checkpoint, training resumes from it: re-running the same command continues an "
            "interrupted run exactly (train.max_steps and train.max_minutes may be raised)."
        ),
    ] = None,
    device: DeviceOption = "auto",
    peer_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="Under torchrun: minutes a process waits for the others before it gives up "
            "with an error (rank 0's validations must fit in it).",
        ),
    ] = 5.0,
) -> None:
    """Train a model; writes config, tokenizers, checkpoints and metrics into a run directory.

    Ctrl-C (or SIGTERM) saves a checkpoint after the current step and exits with status 130;
    a second Ctrl-C exits at once. Under `torchrun --nproc_per_node N -m mtrain train ...`,
    N processes train one model with DistributedDataParallel; rank 0 writes the run.
    """
    from mtrain import distributed  # these keep `translate` light
    from mtrain.train import Interrupted, NonFiniteLoss, RunWriteError, Trainer

    group = distributed.from_env()
    setup_logging(quiet=not group.is_main)
    cfg = config.load(config_path, overrides or [])
    torch_device = runtime.pick_device(device, group.local_rank)
    run_dir = out or RUNS_ROOT / f"{config_path.stem}-{datetime.now():%Y%m%d-%H%M%S}"
    for key in ("train", "dev", "test"):
        path = Path(getattr(cfg.data, key))
        if not path.is_file():
            fail(f"{config_path}: data.{key}: no such file {path}")
        setattr(cfg.data, key, str(path.resolve()))  # the run works from any directory
    if group.is_main:
        check_out(run_dir)
    distributed.start(group, torch_device, peer_timeout)
    try:
        # Rank 0 alone owns the run directory; the others get what they need from it.
        with DirectoryLock(run_dir) if group.is_main else contextlib.nullcontext():
            resume = group.is_main and open_run(run_dir, cfg)
            trainer = Trainer(cfg, run_dir, torch_device, resume, group)
            if group.is_main:
                checkpoint.write_config(run_dir, cfg)  # once the run is known to be resumable
            best = trainer.run()
    except (NonFiniteLoss, RunWriteError) as e:
        fail(str(e))
    except Interrupted as e:
        if group.is_main:
            typer.echo(
                f"mtrain: {e}; checkpoint saved in {run_dir}; run the same command to resume",
                err=True,
            )
        raise typer.Exit(130) from None
    except KeyboardInterrupt:
        last = run_dir / checkpoint.LAST
        kept = f"{last} is intact" if last.exists() else "no checkpoint had been written"
        typer.echo(f"mtrain: stopped; {kept}", err=True)
        raise typer.Exit(130) from None
    except RuntimeError as e:  # torch.distributed's errors: a rank died, hung or disagreed
        if not group.active:
            raise
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        fail(f"rank {group.rank}: lost the other training processes ({first_line[:200]})")
    finally:
        distributed.stop(group)
    if group.is_main:
        log.info("best dev BLEU %.2f", best)
        typer.echo(str(run_dir))


def check_out(run_dir: Path) -> None:
    """Make the run directory, refusing one that holds anything but a run."""
    if run_dir.exists() and not run_dir.is_dir():
        fail(f"--out {run_dir}: exists and is not a directory")
    if run_dir.is_dir() and not is_run_dir(run_dir) and any(run_dir.iterdir()):
        fail(f"--out {run_dir}: holds other files and no run; use a new or empty directory")
    run_dir.mkdir(parents=True, exist_ok=True)


def open_run(run_dir: Path, cfg: Config) -> bool:
    """Clean a locked run directory of what a killed run left; return whether to resume."""
    for leftover in remove_leftovers(run_dir):
        log.info("removed %s, left by an interrupted write", leftover)
    resume = (run_dir / checkpoint.LAST).exists()
    if resume:
        check_resumable(run_dir, cfg)
    log.info("run directory %s", run_dir)
    return resume


def load_translator(
    run: Path | None,
    device: str,
    beam: int | None,
    alpha: float | None,
    quantize: Quantize,
    which: str,
    nbest: int = 1,
) -> tuple[Path, Config, Translator]:
    """Load a run and wrap it in a Translator with the decoding options asked for."""
    torch_device = runtime.pick_device(device)
    runtime.configure(torch_device)
    run_dir = resolve_run(run)
    cfg, tokenizer, model = checkpoint.load_run(run_dir, torch_device, which)
    if quantize is Quantize.int8:
        if torch_device.type != "cpu":
            fail("--quantize int8 runs on the CPU only; add --device cpu")
        model = runtime.quantize_int8(model)
    asked = {"beam_size": beam, "alpha": alpha}
    raw = cfg.to_dict()
    raw["decode"].update({k: v for k, v in asked.items() if v is not None})
    decode = config.from_dict(raw, "options").decode  # the run's own checks, e.g. a finite alpha
    if nbest > decode.beam_size:
        fail(f"--nbest {nbest} needs --beam {nbest} or more")
    return run_dir, cfg, Translator(model, tokenizer, cfg, torch_device, decode, nbest)


def write_translations(out, number: int, translations: list[Translation], nbest: int) -> None:
    """One line (or `nbest` "LINE ||| TRANSLATION ||| SCORE" lines) for input line `number`."""
    if nbest == 1:
        out.write(translations[0].text + "\n")
    else:
        out.writelines(f"{number} ||| {t.text} ||| {t.score:.4f}\n" for t in translations)


def inspect_line(
    translator: Translator, text: str, number: int, trace_k: int | None, attention: Path | None
) -> list[Translation]:
    """Translate one line alone; print its trace on stderr and/or draw its attention maps."""
    tracer = Tracer(trace_k) if trace_k else None
    recorder = AttentionRecorder(translator.model) if attention else None
    observers = [o for o in (tracer, recorder) if o is not None]
    with recorder or contextlib.nullcontext():
        result = translator.inspect(text, lambda event: [o(event) for o in observers])
    if not result.src:  # an empty line: nothing was searched
        return result.translations
    tokenizer = translator.tokenizer
    if tracer is not None:
        best = result.translations[0]
        score = "" if best.score is None else f"   (score {best.score:.4f})"
        trace = format_trace(result.src, tracer.steps[0], tokenizer, text)
        typer.echo(f"{trace}\ntranslation: {best.text}{score}\n", err=True)
    if recorder is not None:
        tokens = result.hypotheses[0].tokens
        maps = recorder.maps(tokens)
        ended = maps.cross[0].size(1) > len(tokens)  # a last query row that chose </s>
        out_ids = [*tokens, EOS_ID] if ended else tokens
        paths = save_figures(
            maps,
            tokenizer.src.id_to_piece(result.src),
            tokenizer.tgt.id_to_piece([BOS_ID, *out_ids[:-1]]),
            tokenizer.tgt.id_to_piece(out_ids),
            f"{text} → {result.translations[0].text}",
            attention / f"{number + 1:03d}",
        )
        log.info("attention maps of line %d: %s", number + 1, " ".join(map(str, paths)))
    return result.translations


def read_line(prompt: str) -> str:
    """input(), with the prompt on stderr when stdout is not the terminal (`> file`)."""
    if sys.stdout.isatty():
        return input(prompt)
    sys.stderr.write(prompt)
    sys.stderr.flush()
    return input()


def typed_lines(prompt: str, read: Callable[[str], str] = read_line) -> Iterator[str]:
    """Non-empty lines typed at a prompt, until end of input (Ctrl-D); Ctrl-C clears the line."""
    with contextlib.suppress(ImportError):  # not on every platform; input() works without it
        import readline  # noqa: F401  gives input() line editing and history
    while True:
        try:
            line = read(prompt).strip()
        except EOFError:
            typer.echo(err=True)
            return
        except KeyboardInterrupt:
            typer.echo(err=True)
            continue
        if line:
            yield line


@app.command()
def translate(
    texts: Annotated[
        list[str] | None,
        typer.Argument(help="Sentences to translate. Default: lines of --input, or of stdin."),
    ] = None,
    input_path: Annotated[
        Path | None,
        typer.Option(
            "--input",
            "-i",
            help="Translate this file, one sentence per line.",
            dir_okay=False,
            exists=True,
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Write translations here instead of stdout."),
    ] = None,
    run: RunOption = None,
    beam: BeamOption = None,
    alpha: AlphaOption = None,
    nbest: Annotated[
        int,
        typer.Option(
            min=1,
            help="Print the N best translations of each line as "
            "'LINE ||| TRANSLATION ||| SCORE' (LINE counts from 0).",
        ),
    ] = 1,
    trace: Annotated[
        bool,
        typer.Option(
            "--trace",
            help="Print on stderr how each sentence is decoded: its source pieces and ids, then "
            "every step (decoder input, the likeliest next pieces, the choice; with --beam: the "
            "live hypotheses and which survive or finish).",
        ),
    ] = False,
    trace_k: Annotated[
        int, typer.Option("--trace-k", min=1, help="Next pieces shown per step by --trace.")
    ] = 5,
    attention: Annotated[
        Path | None,
        typer.Option(
            "--attention",
            help="Draw each sentence's attention weights (cross-attention, encoder and decoder "
            "self-attention, every layer and head) as PNG files into this directory.",
            file_okay=False,
        ),
    ] = None,
    quantize: QuantizeOption = Quantize.none,
    which: CheckpointOption = checkpoint.BEST,
    device: DeviceOption = "auto",
) -> None:
    """Translate sentences; one output line per input line, in input order.

    Input comes from the arguments, --input, or stdin; it is read and translated in chunks, so
    files of any length work in bounded memory. An empty line gives an empty line. --output is
    written under a temporary name and renamed when complete. On a terminal, with no sentences
    and nothing piped in, it prompts for sentences one at a time (Ctrl-D leaves).
    """
    setup_logging()
    if texts and input_path:
        fail("give sentences as arguments or --input, not both")
    run_dir, cfg, translator = load_translator(run, device, beam, alpha, quantize, which, nbest)
    if output is not None:
        check_output(output, [input_path] if input_path else [], run_dir)
    for number, text in enumerate(texts or [], 1):
        if not is_utf8(text):
            fail(f"argument {number}: not valid UTF-8")
    if attention:
        attention.mkdir(parents=True, exist_ok=True)
    interactive = not texts and not input_path and sys.stdin.isatty()
    # SIGTERM unwinds like Ctrl-C, so that a half-written --output is removed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with contextlib.ExitStack() as stack:
            if texts:
                lines = texts
            elif input_path:
                lines = decode_lines(stack.enter_context(input_path.open("rb")), str(input_path))
            elif interactive:
                data = cfg.data
                log.info(
                    "translating %s→%s with %s, beam %d; Ctrl-D leaves",
                    data.src_lang,
                    data.tgt_lang,
                    run_dir,
                    translator.decode.beam_size,
                )
                lines = typed_lines(f"{data.src_lang}> ")
            else:
                lines = decode_lines(sys.stdin.buffer, "<stdin>")
            one_by_one = trace or attention or interactive  # each line shown once it is done
            if one_by_one:
                trace_k_or_none = trace_k if trace else None
                results = (
                    inspect_line(translator, line, number, trace_k_or_none, attention)
                    for number, line in enumerate(lines)
                )
            else:
                results = translator.stream(lines)
            out = (
                stack.enter_context(atomic_open(output, "w", encoding="utf-8"))
                if output
                else sys.stdout
            )
            bar = (input_path or output) and not interactive
            progress = stack.enter_context(tqdm(desc="translate", unit=" lines", disable=not bar))
            for number, translations in enumerate(results):
                write_translations(out, number, translations, nbest)
                if one_by_one:
                    out.flush()
                progress.update(1)
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        kept = f"; {output} was not written" if output else ""
        typer.echo(f"mtrain: interrupted{kept}", err=True)
        raise typer.Exit(130) from None


def check_output(output: Path, inputs: list[Path], run_dir: Path) -> None:
    """Refuse an --output that cannot be written, or that would overwrite what is being read:
    the input, or a file of the run (model, tokenizer, config)."""
    if output.is_dir():
        fail(f"--output {output}: is a directory")
    if not output.parent.is_dir():
        fail(f"--output {output}: no such directory {output.parent}")
    if not output.exists():
        return
    if any(output.samefile(path) for path in inputs):
        fail(f"--output {output}: is the input file; write the translations elsewhere")
    if any(output.samefile(path) for path in run_dir.iterdir() if path.is_file()):
        fail(f"--output {output}: is a file of the run {run_dir}; write the translations elsewhere")


def is_utf8(text: str) -> bool:
    """False for text that came from bytes that are not UTF-8 (Python keeps them as surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@app.command(name="eval")
def evaluate(
    run: RunOption = None,
    src: Annotated[
        Path | None,
        typer.Option(
            help="Source sentences, one per line. Default: the run's test split.",
            dir_okay=False,
            exists=True,
        ),
    ] = None,
    ref: Annotated[
        list[Path] | None,
        typer.Option(
            help="Reference translations, one per line, aligned with --src; repeat for several "
            "references per sentence (an empty line means no reference there).",
            dir_okay=False,
            exists=True,
        ),
    ] = None,
    beam: BeamOption = None,
    alpha: AlphaOption = None,
    quantize: QuantizeOption = Quantize.none,
    which: CheckpointOption = checkpoint.BEST,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    device: DeviceOption = "auto",
) -> None:
    """Translate a test set and print BLEU and chrF with their sacrebleu signatures."""
    setup_logging()
    if (src is None) != (ref is None):
        fail("--src and --ref go together")
    run_dir, cfg, translator = load_translator(run, device, beam, alpha, quantize, which)
    if src is None:
        test = Path(cfg.data.test)
        sources, references = group_references(
            read_parallel(test, cfg.data.src_lang, cfg.data.tgt_lang, cfg.data.swap_columns)
        )
        hyp_path, source_name = run_dir / f"{test.stem}.hyp.{cfg.data.tgt_lang}", test
    else:
        sources = read_lines(src)
        streams = [read_lines(path) for path in ref]
        for path, stream in zip(ref, streams):
            if len(stream) != len(sources):
                fail(f"{path}: {len(stream)} lines, but {src} has {len(sources)}")
        references = [[r for r in refs if r.strip()] for refs in zip(*streams)]
        for number, refs in enumerate(references, 1):
            if not refs:
                fail(f"{src}:{number}: no reference in any --ref file")
        hyp_path, source_name = run_dir / f"{src.name}.hyp.{cfg.data.tgt_lang}", src
    if not sources:
        fail(f"{source_name}: no sentences to evaluate")
    hyps = [t[0].text for t in translator.stream(sources)]
    scores = score(hyps, references, cfg.data.tgt_lang)
    try:
        write_atomic(hyp_path, "".join(h + "\n" for h in hyps))
        log.info("hypotheses written to %s", hyp_path)
    except OSError as e:  # a read-only run directory: the scores still count
        log.warning("mtrain: warning: cannot write %s (%s); scores below", hyp_path, e.strerror)
        hyp_path = None
    if as_json:
        result = {
            "run": str(run_dir),
            "checkpoint": which,
            "sentences": len(hyps),
            "hypotheses": hyp_path and str(hyp_path),
        }
        typer.echo(json.dumps({**result, **vars(scores)}))
    else:
        typer.echo(f"BLEU = {scores.bleu:.2f}  {scores.bleu_signature}")
        typer.echo(f"chrF = {scores.chrf:.2f}  {scores.chrf_signature}")


@app.command()
def average(
    run: RunOption = None,
    last: Annotated[
        int, typer.Option(min=2, help="How many of the newest step-N.pt checkpoints to average.")
    ] = 5,
) -> None:
    """Average the weights of a run's last step checkpoints into averaged.pt; print its path.

    Translate or evaluate with it by adding --checkpoint averaged.pt.
    """
    setup_logging()
    run_dir = resolve_run(run)
    if not (run_dir / checkpoint.CONFIG_FILE).is_file():
        fail(f"{run_dir}: not a run directory (no {checkpoint.CONFIG_FILE})")
    with DirectoryLock(run_dir):  # training writes averaged.pt too
        paths = checkpoint.step_checkpoints(run_dir)
        if len(paths) < last:
            fail(
                f"{run_dir}: {len(paths)} step checkpoints, fewer than --last {last} "
                "(train.keep_last says how many training keeps)"
            )
        state = checkpoint.average(paths[-last:])
        checkpoint.save(run_dir / checkpoint.AVERAGED, state)
    log.info("averaged the checkpoints of steps %s", ", ".join(map(str, state["steps"])))
    typer.echo(str(run_dir / checkpoint.AVERAGED))


OutputOption = Annotated[Path, typer.Option("--output", "-o", help="PNG file to write.")]


@plot_app.command()
def curves(
    runs: Annotated[list[Path], typer.Argument(help="Run directories, one curve each.")],
    output: OutputOption = Path("curves.png"),
) -> None:
    """Training loss, dev loss, dev BLEU and learning rate against steps and against minutes.

    Reads each run's metrics.jsonl and train.jsonl; prints the PNG's path.
    """
    from mtrain import plots
    from mtrain.figures import FigureError, save

    try:
        typer.echo(str(save(plots.curves(runs), output)))
    except (CheckpointError, FigureError, OSError) as e:
        fail(str(e))


def optional_run(run: Path | None) -> Path | None:
    """`run`, else the latest run under ./runs/, else None (no run trained yet)."""
    if run is not None:
        return run
    try:
        return resolve_run(None)
    except CheckpointError:
        return None


@plot_app.command()
def positional(
    run: Annotated[
        Path | None,
        typer.Argument(help="Run whose d_model and lengths to use. Default: the latest run."),
    ] = None,
    output: OutputOption = Path("positional.png"),
) -> None:
    """The sinusoidal positional encoding, from the model's PositionalEncoding module.

    Without a run (and none under ./runs/), default.yaml's d_model and lengths are used.
    """
    from mtrain import plots
    from mtrain.figures import FigureError, save

    setup_logging()
    run = optional_run(run)
    try:
        cfg = config.load(run / checkpoint.CONFIG_FILE) if run else Config()
        max_len = max(cfg.data.max_src_len, cfg.data.max_tgt_len)  # as checkpoint.build_model
        typer.echo(str(save(plots.positional(cfg.model.d_model, max_len), output)))
    except (ConfigError, FigureError, OSError) as e:
        fail(str(e))


@plot_app.command()
def masks(
    texts: Annotated[list[str], typer.Argument(help="Source sentences: one batch.")],
    tgt: Annotated[
        list[str] | None,
        typer.Option(
            help="Target sentence for each source (repeat). Default: the run's own greedy "
            "translations."
        ),
    ] = None,
    run: RunOption = None,
    output: OutputOption = Path("masks.png"),
) -> None:
    """The padding mask of a batch and the decoder's look-ahead mask, as training builds them.

    Pieces come from the run's tokenizers; with no run at all, each character is a piece.
    """
    from mtrain import plots
    from mtrain.figures import FigureError, save
    from mtrain.text import normalize

    setup_logging()
    if tgt and len(tgt) != len(texts):
        fail(f"{len(texts)} sentences but {len(tgt)} --tgt")
    run = optional_run(run)
    try:
        if run is None:
            log.info("no run: one piece per character (source) and per word (--tgt)")
            src_pieces = [list(t) for t in texts]
            tgt_pieces = [t.split() for t in tgt] if tgt else None
            src_ids = [list(range(4, 4 + len(p))) for p in src_pieces]  # any non-padding ids
            tgt_ids = [list(range(4, 4 + len(p))) for p in tgt_pieces] if tgt else None
            max_src_len = Config().data.max_src_len
        else:
            _, cfg, translator = load_translator(run, "cpu", 1, None, Quantize.none, "best.pt")
            sources = [normalize(t, cfg.data.src_lang) for t in texts]
            if not tgt:
                tgt = translator.translate(sources)
                log.info("targets (greedy translations): %s", " | ".join(tgt))
            tok = translator.tokenizer
            src_ids = tok.encode_src(sources)
            tgt_ids = tok.encode_tgt([normalize(t, cfg.data.tgt_lang) for t in tgt])
            tgt_ids = [ids[: cfg.data.max_tgt_len - 1] for ids in tgt_ids]  # as encode_pairs
            src_pieces = [[tok.src.id_to_piece(i) for i in ids] for ids in src_ids]
            tgt_pieces = [[tok.tgt.id_to_piece(i) for i in ids] for ids in tgt_ids]
            max_src_len = cfg.data.max_src_len
        inputs = plots.mask_inputs(src_ids, src_pieces, tgt_ids, tgt_pieces, max_src_len)
        typer.echo(str(save(plots.masks(inputs), output)))
    except (CheckpointError, FigureError, OSError) as e:
        fail(str(e))


@app.command()
def info(
    run: Annotated[
        Path | None,
        typer.Argument(help="Run directory. Default: the latest run under ./runs/."),
    ] = None,
    config_path: Annotated[
        Path | None,
        typer.Option(
            "--config", "-c", help="Describe a config's model instead of a run's.", dir_okay=False
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """The model part by part as the textbook names it, with parameter counts.

    Then the tokenizers' vocabularies, the run's steps, training time, best dev BLEU and
    checkpoints, and its config.
    """
    from mtrain import model_map
    from mtrain.model import Transformer
    from mtrain.tokenizer import Tokenizer

    setup_logging()
    if run is not None and config_path is not None:
        fail("give a run or --config, not both")
    try:
        if config_path is not None:
            cfg, tokenizer, summary = config.load(config_path), None, None
            vocab = (cfg.tokenizer.vocab_size, cfg.tokenizer.vocab_size)
        else:
            run = resolve_run(run)
            cfg = config.load(run / checkpoint.CONFIG_FILE)
            tokenizer = Tokenizer.load(run)
            vocab = (tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
            summary = checkpoint.training_summary(run)
    except (CheckpointError, ConfigError, OSError) as e:
        fail(str(e))
    max_len = max(cfg.data.max_src_len, cfg.data.max_tgt_len)
    model = Transformer(cfg.model, *vocab, max_len, 0, joint_vocab=cfg.tokenizer.joint)
    parts = model_map.parts(model)
    tokenizers = {
        "joint": cfg.tokenizer.joint,
        "model_type": cfg.tokenizer.model_type,
        "src_vocab": vocab[0],
        "tgt_vocab": vocab[1],
        "trained": tokenizer is not None,
    }
    if as_json:
        result = {
            "run": None if run is None else str(run),
            "direction": f"{cfg.data.src_lang}-{cfg.data.tgt_lang}",
            "parameters": model_map.total(parts),
            "parts": [dataclasses.asdict(p) for p in parts],
            "tokenizer": tokenizers,
            "training": summary,
            "config": cfg.to_dict(),
        }
        typer.echo(json.dumps(result, ensure_ascii=False))
        return
    echo = typer.echo
    echo(f"{run or config_path}: {cfg.data.src_lang}→{cfg.data.tgt_lang} Transformer")
    echo("")
    for line in model_map.render(parts):
        echo(line)
    echo(f"total: {model_map.total(parts):,} parameters (a shared matrix is counted once)")
    echo("")
    kind = "one joint model" if cfg.tokenizer.joint else "one model per language"
    how = "trained" if tokenizer is not None else "configured size, not trained yet"
    echo(f"tokenizer: SentencePiece {cfg.tokenizer.model_type}, {kind} ({how})")
    echo(f"  source vocabulary ({cfg.data.src_lang}): {vocab[0]:,} pieces")
    echo(f"  target vocabulary ({cfg.data.tgt_lang}): {vocab[1]:,} pieces")
    if summary is not None:
        echo("")
        echo(
            f"training: {summary['steps']:,} steps in {summary['minutes']:.1f} minutes, "
            f"{summary['validations']} validations"
        )
        if summary["best_dev_bleu"] is not None:
            of = " (the averaged checkpoints)" if summary["best_is_average"] else ""
            echo(f"  best dev BLEU (greedy): {summary['best_dev_bleu']:.2f}{of}")
        for name, size in summary["checkpoints"].items():
            echo(f"  {name:<18}{size / 2**20:8.1f} MiB")
    echo("")
    echo("config:")
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False, allow_unicode=True)
    echo(textwrap.indent(text, "  ").rstrip())
