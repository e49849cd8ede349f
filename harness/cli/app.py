"""The typer application every command registers on, with click's own parse
errors turned into one line and exit 2. Imports nothing of ddcheck.

Layer: cli. Imports any layer below it."""
from __future__ import annotations

import sys

import typer
from typer._click import exceptions as click_errors   # typer's own copy of click: its exceptions are these
from typer.core import TyperGroup


class OneLineErrors(TyperGroup):
    """Click's own parse errors (a value that is no integer, an unknown option
    or command, a missing argument) as one stderr line and exit 2, like every
    other usage error, instead of a usage banner and a framed box."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_errors.NoArgsIsHelpError as e:   # a bare `ddcheck`: the help, as before
            from typer import rich_utils
            rich_utils.rich_format_error(e)
            sys.exit(e.exit_code)
        except click_errors.ClickException as e:
            typer.echo(f"ddcheck: error: {' '.join(e.format_message().split())}", err=True)
            sys.exit(2)
        except typer.Abort:
            typer.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(cls=OneLineErrors, add_completion=False, no_args_is_help=True,
                  help="Differential checks of DDTree verify (SGLang layout) against a float64 oracle.")


@app.callback()
def _root() -> None:
    """ddcheck: DDTree verify, checked node by node against a float64 oracle."""
