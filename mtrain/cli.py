"""The `mtrain` command line: parse arguments, call the library, print results on stdout."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer
from tqdm import tqdm

from mtrain import checkpoint, config, runtime
from mtrain.attention import AttentionRecorder, save_figures
from mtrain.checkpoint import CheckpointError
from mtrain.config import Config, ConfigError
from mtrain.data import DataError, group_references, read_lines, read_parallel
from mtrain.evaluate import score
from mtrain.tokenizer import BOS_ID, EOS_ID
from mtrain.trace import Tracer, format_trace
from mtrain.translate import Translation, Translator

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Train Transformer translation models and translate with them.",
)
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


def fail(message: str) -> None:
    typer.echo(f"mtrain: error: {message}", err=True)
    raise typer.Exit(2)


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)


def resolve_run(run: Path | None) -> Path:
    if run is not None:
        return run
    run = checkpoint.latest_run(RUNS_ROOT)
    log.info("using run %s", run)
    return run


RESUMABLE_KEYS = {"max_steps", "max_minutes"}  # train.* keys a resumed run may change


def check_resumable(run_dir: Path, cfg: Config) -> None:
    """Refuse to resume a run with a config other than its own (but for its limits)."""
    try:
        saved = config.load(run_dir / checkpoint.CONFIG_FILE).to_dict()
    except ConfigError as e:
        fail(str(e))
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
) -> None:
    """Train a model; writes config, tokenizers, checkpoints and metrics into a run directory.

    Ctrl-C (or SIGTERM) saves a checkpoint after the current step and exits with status 130;
    a second Ctrl-C exits at once.
    """
    from mtrain.train import Interrupted, NonFiniteLoss, Trainer  # keeps `translate` light

    setup_logging()
    try:
        cfg = config.load(config_path, overrides or [])
        run_dir = out or RUNS_ROOT / f"{config_path.stem}-{datetime.now():%Y%m%d-%H%M%S}"
        for key in ("train", "dev", "test"):
            path = Path(getattr(cfg.data, key))
            if not path.is_file():
                fail(f"{config_path}: data.{key}: no such file {path}")
            setattr(cfg.data, key, str(path.resolve()))  # the run works from any directory
        resume = (run_dir / checkpoint.LAST).exists()
        if resume:
            check_resumable(run_dir, cfg)
        run_dir.mkdir(parents=True, exist_ok=True)
        checkpoint.write_config(run_dir, cfg)
        log.info("run directory %s", run_dir)
        trainer = Trainer(cfg, run_dir, runtime.pick_device(device), resume=resume)
        best = trainer.run()
    except (ConfigError, DataError, CheckpointError, NonFiniteLoss) as e:
        fail(str(e))
    except Interrupted as e:
        typer.echo(
            f"mtrain: {e}; checkpoint saved in {run_dir}; run the same command to resume",
            err=True,
        )
        raise typer.Exit(130) from None
    except KeyboardInterrupt:
        typer.echo(f"mtrain: stopped; the last checkpoint in {run_dir} is intact", err=True)
        raise typer.Exit(130) from None
    log.info("best dev BLEU %.2f", best)
    typer.echo(str(run_dir))


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
    decode = dataclasses.replace(cfg.decode, **{k: v for k, v in asked.items() if v is not None})
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
    files of any length work in bounded memory. An empty line gives an empty line. On a
    terminal, with no sentences and nothing piped in, it prompts for sentences one at a time
    (Ctrl-D leaves).
    """
    setup_logging()
    if texts and input_path:
        fail("give sentences as arguments or --input, not both")
    interactive = not texts and not input_path and sys.stdin.isatty()
    try:
        run_dir, cfg, translator = load_translator(run, device, beam, alpha, quantize, which, nbest)
        stream = input_path.open(encoding="utf-8-sig") if input_path else None
        if attention:
            attention.mkdir(parents=True, exist_ok=True)
    except (CheckpointError, OSError) as e:
        fail(str(e))
    if interactive:
        beam_size, data = translator.decode.beam_size, cfg.data
        languages = f"{data.src_lang}→{data.tgt_lang}"
        log.info("translating %s with %s, beam %d; Ctrl-D leaves", languages, run_dir, beam_size)
        lines = typed_lines(f"{data.src_lang}> ")
    else:
        lines = texts if texts else (line.rstrip("\r\n") for line in (stream or sys.stdin))
    one_by_one = trace or attention or interactive  # each line shown as soon as it is done
    if one_by_one:
        trace_k_or_none = trace_k if trace else None
        results = (
            inspect_line(translator, line, number, trace_k_or_none, attention)
            for number, line in enumerate(lines)
        )
    else:
        results = translator.stream(lines)
    out = output.open("w", encoding="utf-8") if output else sys.stdout
    bar = (input_path or output) and not interactive
    progress = tqdm(desc="translate", unit=" lines", disable=not bar)
    try:
        for number, translations in enumerate(results):
            write_translations(out, number, translations, nbest)
            if one_by_one:
                out.flush()
            progress.update(1)
    except UnicodeDecodeError as e:
        fail(f"{input_path or 'stdin'}: not valid UTF-8 ({e.reason})")
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo(err=True)
        raise typer.Exit(130) from None
    finally:
        progress.close()
        if output:
            out.close()
        if stream:
            stream.close()


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
    try:
        run_dir, cfg, translator = load_translator(run, device, beam, alpha, quantize, which)
        if src is None:
            test = Path(cfg.data.test)
            sources, references = group_references(
                read_parallel(test, cfg.data.src_lang, cfg.data.tgt_lang)
            )
            hyp_path = run_dir / f"{test.stem}.hyp.{cfg.data.tgt_lang}"
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
            hyp_path = run_dir / f"{src.name}.hyp.{cfg.data.tgt_lang}"
    except (CheckpointError, DataError) as e:
        fail(str(e))
    hyps = [t[0].text for t in translator.stream(sources)]
    hyp_path.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    scores = score(hyps, references, cfg.data.tgt_lang)
    log.info("hypotheses written to %s", hyp_path)
    if as_json:
        result = {
            "run": str(run_dir),
            "checkpoint": which,
            "sentences": len(hyps),
            "hypotheses": str(hyp_path),
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
    try:
        run_dir = resolve_run(run)
        paths = checkpoint.step_checkpoints(run_dir)
        if len(paths) < last:
            fail(
                f"{run_dir}: {len(paths)} step checkpoints, fewer than --last {last} "
                "(train.keep_last says how many training keeps)"
            )
        state = checkpoint.average(paths[-last:])
        checkpoint.save(run_dir / checkpoint.AVERAGED, state)
    except CheckpointError as e:
        fail(str(e))
    log.info("averaged the checkpoints of steps %s", ", ".join(map(str, state["steps"])))
    typer.echo(str(run_dir / checkpoint.AVERAGED))
