"""The `mtrain` command line: parse arguments, call the library, print results on stdout."""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import sys
import textwrap
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer
import yaml
from tqdm import tqdm

from mtrain import checkpoint, config, runtime
from mtrain.checkpoint import CheckpointError
from mtrain.config import Config, ConfigError
from mtrain.data import DataError, group_references, read_lines, read_parallel
from mtrain.evaluate import score
from mtrain.translate import Translator

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
    quantize: QuantizeOption = Quantize.none,
    which: CheckpointOption = checkpoint.BEST,
    device: DeviceOption = "auto",
) -> None:
    """Translate sentences; one output line per input line, in input order.

    Input comes from the arguments, --input, or stdin; it is read and translated in chunks, so
    files of any length work in bounded memory. An empty line gives an empty line.
    """
    setup_logging()
    if texts and input_path:
        fail("give sentences as arguments or --input, not both")
    try:
        _, _, translator = load_translator(run, device, beam, alpha, quantize, which, nbest)
        stream = input_path.open(encoding="utf-8-sig") if input_path else None
    except (CheckpointError, OSError) as e:
        fail(str(e))
    lines = texts if texts else (line.rstrip("\r\n") for line in (stream or sys.stdin))
    out = output.open("w", encoding="utf-8") if output else sys.stdout
    progress = tqdm(desc="translate", unit=" lines", disable=not (input_path or output))
    try:
        for number, translations in enumerate(translator.stream(lines)):
            if nbest == 1:
                out.write(translations[0].text + "\n")
            else:
                out.writelines(f"{number} ||| {t.text} ||| {t.score:.4f}\n" for t in translations)
            progress.update(1)
    except UnicodeDecodeError as e:
        fail(f"{input_path or 'stdin'}: not valid UTF-8 ({e.reason})")
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(1) from None
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
                read_parallel(test, cfg.data.src_lang, cfg.data.tgt_lang, cfg.data.swap_columns)
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
