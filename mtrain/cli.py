"""The `mtrain` command line: the commands of `mtrain.commands`, and one line per error."""

from __future__ import annotations

import sys

import typer

from mtrain.commands import (
    evaluate,
    export,
    info,
    lab,
    plot,
    prepare,
    score,
    serve,
    train,
    translate,
)
from mtrain.commands.common import error, file_error
from mtrain.core.errors import MtrainError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Train Transformer translation models and translate with them.",
)
app.command()(prepare.prepare)
app.command()(train.train)
app.command()(translate.translate)
app.command()(score.score)
app.command(name="eval")(evaluate.evaluate)
app.command()(evaluate.average)
app.add_typer(plot.app, name="plot")
app.command()(info.info)
app.command()(lab.lab)
app.command()(export.export)
app.command()(serve.serve)


def main(argv: list[str] | None = None) -> None:
    """The `mtrain` console script: every error is one line on stderr and a non-zero status."""
    try:
        status = app(argv, prog_name="mtrain", standalone_mode=False)
    except MtrainError as e:  # of the user's making (input, files, config, devices)
        status = error(str(e))
    except (KeyboardInterrupt, typer.Abort):  # Ctrl-C (typer returns 130; older ones raise Abort)
        typer.echo("mtrain: interrupted", err=True)
        status = 130
    except OSError as e:  # a file that cannot be read or written
        status = error(file_error(e))
    except Exception as e:
        if not hasattr(e, "format_message"):  # not a command-line usage error: a bug
            raise
        message = e.format_message()  # a bad option or argument, from the parser
        if not message:  # `mtrain` alone: the parser printed the help
            sys.exit(2)
        command = getattr(getattr(e, "ctx", None), "command_path", "mtrain")
        status = error(f"{message.rstrip('.')} (see {command} --help)")
    sys.exit(status if isinstance(status, int) else 0)
