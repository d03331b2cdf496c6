"""`mtrain info`: the model as the textbook names it, with its tokenizers and training."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import yaml

from mtrain.commands.common import JsonOption, fail, resolve_run, setup_logging
from mtrain.core import config
from mtrain.core.config import Config
from mtrain.run.directory import build_model, run_config, training_summary

if TYPE_CHECKING:
    from mtrain.data.tokenizer import Tokenizer
    from mtrain.model.parameter_map import Part


RunArgument = Annotated[
    Path | None,
    typer.Argument(help="Run directory. Default: the latest run under ./runs/."),
]


ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config", "-c", help="Describe a config's model instead of a run's.", dir_okay=False
    ),
]


def info(
    run: RunArgument = None, config_path: ConfigOption = None, as_json: JsonOption = False
) -> None:
    """The model part by part as the textbook names it, with parameter counts.

    Then the tokenizers' vocabularies, the run's steps, training time, best dev BLEU and
    checkpoints, and its config.
    """
    from mtrain.model import parameter_map

    setup_logging()
    if run is not None and config_path is not None:
        fail("give a run or --config, not both")
    parent, schema = None, None
    if config_path is not None:
        cfg, tokenizer, summary = config.load(config_path), None, None
    else:
        from mtrain.run import lineage

        run, cfg, tokenizer, summary = read_run(run)
        parent, schema = lineage.recorded(run), read_schema(run, cfg)
    model = build_model(cfg, tokenizer)
    parts = parameter_map.parts(model)
    tokenizers = {
        "joint": cfg.tokenizer.joint,
        "model_type": cfg.tokenizer.model_type,
        "src_vocab": model.src_embed.tokens.num_embeddings,
        "tgt_vocab": model.tgt_embed.tokens.num_embeddings,
        "trained": tokenizer is not None,
    }
    if as_json:
        result = {
            "run": None if run is None else str(run),
            "direction": f"{cfg.data.src_lang}-{cfg.data.tgt_lang}",
            "parameters": parameter_map.total(parts),
            "parts": [dataclasses.asdict(p) for p in parts],
            "tokenizer": tokenizers,
            "training": summary,
            "parent": parent,
            "schema": schema,
            "config": cfg.to_dict(),
        }
        typer.echo(json.dumps(result, ensure_ascii=False))
        return
    typer.echo(f"{run or config_path}: {cfg.data.src_lang}→{cfg.data.tgt_lang} Transformer")
    if config.MODEL_VARIANTS[cfg.model.variant].lacks:  # the textbook's model has nothing swapped
        typer.echo(f"variant {cfg.model.variant}: {config.MODEL_VARIANTS[cfg.model.variant].lacks}")
    if parent is not None:
        from mtrain.run.lineage import describe

        typer.echo(describe(parent))
    if schema is not None and schema["upgraded_from"] is not None:
        typer.echo(describe_schema(schema))
    echo_text(cfg, parts, tokenizers, summary)


def read_schema(run: Path, cfg: Config) -> dict[str, Any]:
    """The config schema a run's config.yaml is in, the one it was begun in where older, and
    the keys its record lacks, with the value each takes (declared beside the key: config.py)."""
    from mtrain.run.directory import recorded_version, run_record, upgraded_from

    record = run_record(run)
    filled = {
        f"{section}.{name}": getattr(getattr(cfg, section), name)
        for (section, name), policy in config.POLICIES.items()
        if policy.added is not None and name not in (record.get(section) or {})
    }
    version = recorded_version(run)
    return {"version": version, "upgraded_from": upgraded_from(run), "filled_in": filled}


def describe_schema(schema: dict[str, Any]) -> str:
    """One line: the older mtrain's config version a run was begun in, and what was read."""
    if schema["version"] < config.VERSION:
        keys = ", ".join(f"{key}={value!r}" for key, value in schema["filled_in"].items())
        return (
            f"config version {schema['version']}, read as version {config.VERSION} (begun by an "
            f"older mtrain; a resume upgrades it){': ' + keys if keys else ''}"
        )
    return f"config upgraded from version {schema['upgraded_from']} by a resume"


def read_run(run: Path | None) -> tuple[Path, Config, Tokenizer, dict[str, Any]]:
    """A run's config, tokenizer and training summary; the latest run when none is named."""
    from mtrain.data.tokenizer import Tokenizer

    run = resolve_run(run)
    cfg = run_config(run)
    tokenizer = Tokenizer.load(run)
    return run, cfg, tokenizer, training_summary(run)


def echo_text(
    cfg: Config, parts: list[Part], tokenizers: dict[str, Any], summary: dict[str, Any] | None
) -> None:
    """What `info` prints without --json, below its first line: model, tokenizers, training,
    config."""
    from mtrain.model import parameter_map

    echo = typer.echo
    echo("")
    for line in parameter_map.render(parts):
        echo(line)
    echo(f"total: {parameter_map.total(parts):,} parameters (a shared matrix is counted once)")
    echo("")
    kind = "one joint model" if cfg.tokenizer.joint else "one model per language"
    how = "trained" if tokenizers["trained"] else "configured size, not trained yet"
    echo(f"tokenizer: SentencePiece {cfg.tokenizer.model_type}, {kind} ({how})")
    echo(f"  source vocabulary ({cfg.data.src_lang}): {tokenizers['src_vocab']:,} pieces")
    echo(f"  target vocabulary ({cfg.data.tgt_lang}): {tokenizers['tgt_vocab']:,} pieces")
    if summary is not None:
        echo("")
        echo_training(summary, cfg.train.lr)
    echo("")
    echo("config:")
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False, allow_unicode=True)
    echo(textwrap.indent(text, "  ").rstrip())


def echo_training(summary: dict[str, Any], peak_lr: float) -> None:
    """A run's training: steps, minutes, validations, best dev BLEU, why it ended (its
    learning rate then, against `peak_lr`) and checkpoint sizes."""
    echo = typer.echo
    echo(
        f"training: {summary['steps']:,} steps in {summary['minutes']:.1f} minutes, "
        f"{summary['validations']} validations"
    )
    if summary["best_dev_bleu"] is not None:
        of = " (the averaged checkpoints)" if summary["best_is_average"] else ""
        echo(f"  best dev BLEU (greedy): {summary['best_dev_bleu']:.2f}{of}")
    if summary["finished"] is not None:
        finished, lr = summary["finished"], summary["finished"]["lr"]
        then = (
            "" if lr is None else f"; learning rate then {lr:.2e} ({lr / peak_lr:.0%} of its peak)"
        )
        echo(f"  finished: {finished['reason']}{then}")
    if summary["chosen"] is not None:  # budget_recipe.py
        chosen = summary["chosen"]
        planned = chosen["planned_updates"]
        plan = "begun before runs chose" if planned is None else f"of {planned:,} updates"
        echo(f"  chosen from its plan {plan}: dropout {chosen['dropout']:g}")
    for name, size in summary["checkpoints"].items():
        echo(f"  {name:<18}{size / 2**20:8.1f} MiB")
