"""`mtrain prepare`: encode the training corpora once, for every run that trains on them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mtrain.commands.common import setup_logging
from mtrain.core import config
from mtrain.training.start import resolve_data


def prepare(
    config_path: Annotated[
        Path, typer.Option("--config", "-c", help="YAML config file, e.g. configs/default.yaml.")
    ],
    overrides: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override one config key, e.g. --set data.max_len_ratio=3."),
    ] = None,
) -> None:
    """Clean and encode the training corpora into flat token arrays; print their
    directory.

    `mtrain train` does this by itself when the prepared corpus is missing or stale (a
    training file, the tokenizer settings or the cleaning rules changed); run it ahead to
    prepare a large corpus once, on the machine and at the time of your choosing. It also
    reads every prepared file back, and prepares again a directory a disk or a copy damaged.
    A config with train.init_from encodes with that run's tokenizer, as its training will.
    """
    from mtrain.data.prepare import prepare as prepare_corpus  # keeps other commands light

    setup_logging()
    cfg = config.load(config_path, overrides or [], require_data=True)
    resolve_data(cfg, config_path)
    tokenizer = None
    if cfg.train.init_from:
        from mtrain.run.lineage import parent_of

        tokenizer = parent_of(cfg, config_path, overrides or []).tokenizer()
    typer.echo(str(prepare_corpus(cfg, repair=True, tokenizer=tokenizer)))
