"""`mtrain translate`: sentences, files, pipes or a prompt; with --trace and --attention."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Annotated, TextIO

import typer

from mtrain.commands.common import (
    AlphaOption,
    BeamOption,
    CheckpointOption,
    Decoding,
    DeviceOption,
    Engine,
    EngineOption,
    Quantize,
    QuantizeOption,
    RunOption,
    fail,
    load_engine,
    log,
    quiet_matplotlib_dirs,
    setup_logging,
)
from mtrain.core import progress as progress_bar
from mtrain.core.files import (
    OutputKind,
    check_arguments,
    check_input_encoding,
    check_output,
    open_output,
    output_kind,
)
from mtrain.data.pairs import decode_lines
from mtrain.data.tokenizer import Tokenizer
from mtrain.decoding.attention import AttentionRecorder
from mtrain.decoding.trace import Tracer, format_trace
from mtrain.decoding.translator import Inspection, Translation, Translator
from mtrain.figures.attention import save_figures
from mtrain.run.directory import BEST


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
    if tracer is not None:
        print_trace(tracer, result, translator.tokenizer, text)
    if recorder is not None:
        stem = attention / f"{number + 1:03d}"
        paths = draw_attention(recorder, result, translator.tokenizer, text, stem)
        log.info("attention maps of line %d: %s", number + 1, " ".join(map(str, paths)))
    return result.translations


def print_trace(tracer: Tracer, result: Inspection, tokenizer: Tokenizer, text: str) -> None:
    """--trace: how the line was decoded, step by step, then its translation, on stderr."""
    best = result.translations[0]
    score = "" if best.score is None else f"   (score {best.score:.4f})"
    trace = format_trace(result.src, tracer.steps[0], tokenizer, text)
    typer.echo(f"{trace}\ntranslation: {best.text}{score}\n", err=True)


def draw_attention(
    recorder: AttentionRecorder, result: Inspection, tokenizer: Tokenizer, text: str, stem: Path
) -> list[Path]:
    """--attention: the line's attention maps, as PNG files named from `stem`."""
    tokens = result.hypotheses[0].tokens
    maps = recorder.maps(tokens)
    labels = maps.axis_labels(result.src, tokens, tokenizer)
    title = f"{text} → {result.translations[0].text}"
    return save_figures(maps, labels.source, labels.decoder_input, labels.output, title, stem)


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


TextsArgument = Annotated[
    list[str] | None,
    typer.Argument(help="Sentences to translate. Default: lines of --input, or of stdin."),
]


InputOption = Annotated[
    Path | None,
    typer.Option(
        "--input",
        "-i",
        help="Translate this file, one sentence per line.",
        dir_okay=False,
        exists=True,
    ),
]


OutputOption = Annotated[
    Path | None,
    typer.Option("--output", "-o", help="Write translations here instead of stdout."),
]


NbestOption = Annotated[
    int,
    typer.Option(
        min=1,
        help="Print the N best translations of each line as "
        "'LINE ||| TRANSLATION ||| SCORE' (LINE counts from 0).",
    ),
]


TraceOption = Annotated[
    bool,
    typer.Option(
        "--trace",
        help="Print on stderr how each sentence is decoded: its source pieces and ids, then "
        "every step (decoder input, the likeliest next pieces, the choice; with --beam: the "
        "live hypotheses and which survive or finish).",
    ),
]


TraceKOption = Annotated[
    int, typer.Option("--trace-k", min=1, help="Next pieces shown per step by --trace.")
]


AttentionOption = Annotated[
    Path | None,
    typer.Option(
        "--attention",
        help="Draw each sentence's attention weights (cross-attention, encoder and decoder "
        "self-attention, every layer and head) as PNG files into this directory.",
        file_okay=False,
    ),
]


def translate(
    texts: TextsArgument = None,
    input_path: InputOption = None,
    output: OutputOption = None,
    run: RunOption = None,
    beam: BeamOption = None,
    alpha: AlphaOption = None,
    nbest: NbestOption = 1,
    trace: TraceOption = False,
    trace_k: TraceKOption = 5,
    attention: AttentionOption = None,
    quantize: QuantizeOption = Quantize.none,
    which: CheckpointOption = BEST,
    device: DeviceOption = "auto",
    engine: EngineOption = Engine.mtrain,
) -> None:
    """Translate sentences; one output line per input line, in input order.

    Input comes from the arguments, --input, or stdin; it is read and translated in chunks, so
    files of any length work in bounded memory. An empty line gives an empty line. A file given
    as --output is written under a temporary name and renamed when complete; a device, a FIFO
    or /dev/stdout is written in place. On a terminal, with no sentences and nothing piped in,
    it prompts for sentences one at a time (Ctrl-D leaves).
    """
    setup_logging()
    if texts and input_path:
        fail("give sentences as arguments or --input, not both")
    if engine is Engine.ctranslate2 and (trace or attention):
        fail("--trace and --attention need --engine mtrain")
    decoding = Decoding(run, device, quantize, which, beam, alpha, nbest)
    run_dir, cfg, translator = load_engine(engine, decoding)
    from_stdin = not texts and not input_path
    if output is not None:
        check_output(output, [input_path] if input_path else [], run_dir, from_stdin)
    check_arguments(texts or [])
    if input_path:
        check_input_encoding(input_path)
    if attention:
        quiet_matplotlib_dirs()
        attention.mkdir(parents=True, exist_ok=True)
    interactive = from_stdin and sys.stdin.isatty()
    if interactive:
        src, tgt, beam_size = cfg.data.src_lang, cfg.data.tgt_lang, translator.decode.beam_size
        log.info("translating %s→%s with %s, beam %d; Ctrl-D leaves", src, tgt, run_dir, beam_size)
    one_by_one = trace or attention or interactive  # each line shown once it is done
    write = write_nbest if nbest > 1 else write_best
    with interruptible(output), contextlib.ExitStack() as stack:
        lines = input_lines(stack, texts, input_path, cfg.data.src_lang if interactive else None)
        if one_by_one:
            results = one_at_a_time(translator, lines, trace_k if trace else None, attention)
        else:
            results = translator.stream(lines)
        out = stack.enter_context(open_output(output, "w", encoding="utf-8")) if output else None
        bar = bool(input_path or output) and not interactive
        write_all(results, out or sys.stdout, write, flush=one_by_one, progress=bar)


def write_best(out: TextIO, number: int, translations: list[Translation]) -> None:
    """Input line `number`'s best translation, on one line."""
    out.write(translations[0].text + "\n")


def write_nbest(out: TextIO, number: int, translations: list[Translation]) -> None:
    """Input line `number`'s translations, best first, as "LINE ||| TRANSLATION ||| SCORE"."""
    out.writelines(f"{number} ||| {t.text} ||| {t.score:.4f}\n" for t in translations)


Writer = Callable[[TextIO, int, list[Translation]], None]


def write_all(
    results: Iterable[list[Translation]], out: TextIO, write: Writer, flush: bool, progress: bool
) -> None:
    """Write each input line's translations as they come, with a progress bar on stderr."""
    with progress_bar.bar(desc="translate", unit=" lines", disable=not progress) as bar:
        for number, translations in enumerate(results):
            write(out, number, translations)
            if flush:
                out.flush()
            bar.update(1)


def one_at_a_time(
    translator: Translator, lines: Iterable[str], trace_k: int | None, attention: Path | None
) -> Iterator[list[Translation]]:
    """Each line translated alone, as soon as it is read, with its trace and attention maps."""
    for number, line in enumerate(lines):
        yield inspect_line(translator, line, number, trace_k, attention)


def input_lines(
    stack: contextlib.ExitStack, texts: list[str] | None, path: Path | None, typed: str | None
) -> Iterable[str]:
    """The lines to translate: the arguments, the file, lines typed at a prompt that names the
    source language `typed`, or stdin."""
    if texts:
        return texts
    if path:
        return decode_lines(stack.enter_context(path.open("rb")), str(path))
    if typed is not None:
        return typed_lines(f"{typed}> ")
    return decode_lines(sys.stdin.buffer, "<stdin>")


@contextlib.contextmanager
def interruptible(output: Path | None) -> Iterator[None]:
    """End quietly when the reader goes away (exit 1) or on Ctrl-C or SIGTERM (exit 130)."""
    # SIGTERM unwinds like Ctrl-C, so that a half-written --output is removed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        replaced = output is not None and output_kind(output) is OutputKind.FILE
        kept = f"; {output} was not written" if replaced else ""  # a FIFO holds what was sent
        typer.echo(f"mtrain: interrupted{kept}", err=True)
        raise typer.Exit(130) from None
