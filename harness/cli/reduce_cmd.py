"""`ddcheck reduce`: the smallest setting that still fails, as a case file and a repro script.

Layer: cli. Imports any layer below it."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from harness.cli.app import app
from harness.cli.common import USAGE_ERRORS, check_creatable, fail_usage


def default_out(records: Path) -> Path:
    return Path("reports") / f"reduce-{records.stem}"


WRITTEN = ("case.toml", "repro.py", "model")   # what reduce writes into DIR


def check_out_dir(out: Path, records: Path) -> None:
    """DIR is a directory or can be made one, before any work; what reduce
    writes there is absent or a regular file (a folder for `model`), and none
    of it is the records being read."""
    from harness.check.outputs import refuse_unsafe
    from harness.engine.settings import UsageError
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UsageError(f"--out {out}: is not a directory" + (" (a symbolic link)" if out.is_symlink() else ""))
    check_creatable("--out", out, out)
    for name in WRITTEN[:2]:
        refuse_unsafe("--out", out / name)
    model = out / "model"
    if model.is_symlink() or (model.exists() and not model.is_dir()):
        raise UsageError(f"--out {out}: {model} is not a directory reduce may write a checkpoint into")
    held = Path(os.path.realpath(records))
    for name in WRITTEN:
        if held.is_relative_to(os.path.realpath(out / name)):
            raise UsageError(f"--out {out}: reduce writes {out / name}, which is the records it reads ({records})")


@app.command()
def reduce(
    records: Path = typer.Argument(..., help="a failing run's records (JSONL); its first failing summary is reduced"),
    out: Optional[Path] = typer.Option(None, help="directory for case.toml and repro.py (default reports/reduce-<name>)"),
) -> None:
    """Find the smallest setting that still fails as the recorded run did (fewest requests, tokens, layers,
    shortest prompt, smallest budget and topk) and write DIR/case.toml and DIR/repro.py; exit 0 when written,
    2 on usage (a bad path, records with no failing run, a setting that no longer fails)."""
    from harness.workflows.reduce import reduce_records
    out = out or default_out(records)
    try:
        check_out_dir(out, records)
        result = reduce_records(records, out, lambda line: typer.echo(line))
    except USAGE_ERRORS as e:
        fail_usage(e)
    s = result.reduced.settings
    typer.echo(f"reduced: {s.command()}")
    typer.echo(f"  {result.reduced.layers} layers, prompt lengths {[len(p.tokens) for p in result.reduced.prompts]}; "
               f"first divergence: {result.first}" + (f" [{result.fault_class}]" if result.fault_class else ""))
    typer.echo(f"wrote {out / 'case.toml'} and {out / 'repro.py'} (python {out / 'repro.py'}: exit 1 while it diverges)")
