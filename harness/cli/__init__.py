"""`ddcheck` command line. Every command exits 0 (all match), 1 (divergence),
2 (usage or environment error, one line on stderr, nothing written), 3
(ddcheck's own error, or the oracle's) or 130 (interrupted); docs/RECORDS.md,
"Exit codes"."""
from __future__ import annotations

import sys

import typer
from typer._click import exceptions as click_errors   # typer's own copy of click: its exceptions are these
from typer.core import TyperGroup

from harness.cli.common import USAGE_ERRORS, exit_usage


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


def _register() -> None:
    from harness.cli import run_cmd  # noqa: F401
    for optional in ("faults_cmd", "sweep_cmd", "gate_cmd", "report_cmd", "ports_cmd", "calibrate_cmd", "reduce_cmd",
                     "models_cmd"):
        try:
            __import__(f"harness.cli.{optional}")
        except ModuleNotFoundError as e:
            if e.name != f"harness.cli.{optional}":
                raise


def main() -> None:
    # The presets are tiny: extra intra-op threads only fight over the cores
    # (measured: --batch 4 ran 2x faster on 1 thread than on 2). Sweeps use processes.
    import os
    import torch
    from harness.cli.common import threads_from_env
    try:
        torch.set_num_threads(threads_from_env(os.environ))
    except USAGE_ERRORS as e:
        exit_usage(e)
    _register()
    try:
        app(standalone_mode=True)
    except USAGE_ERRORS as e:  # raised outside a command's own handling
        exit_usage(e)


if __name__ == "__main__":
    sys.exit(main())
