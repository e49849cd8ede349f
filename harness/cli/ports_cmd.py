"""`ddcheck ports`: the port families and their conventions.

Layer: cli. Imports any layer below it."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harness.cli.app import app


@app.command()
def ports(probe: Optional[Path] = typer.Option(None, "--probe", help="say which family fits this port file or "
                                                 "checkout (exit 0 one fits, 1 none fits, 2 no such path)")) -> None:
    """List the DDTree port families `--impl FAMILY:PATH` can drive, with their conventions."""
    from harness.ports.registry import families
    if probe is not None:
        raise typer.Exit(_probe(probe))
    t = Table(title="port families (ddcheck run --impl FAMILY:PATH)", show_lines=True)
    for col in ("family", "stages", "budget", "topk", "padding rows", "mask", "code"):
        t.add_column(col, overflow="fold")
    for fam in families().values():
        c = fam.describe() if fam.describe else None
        if c is None:
            t.add_row(fam.name, "?", "?", "?", "?", "?", "(conventions known once loaded)")
            continue
        t.add_row(*(escape(x) for x in (   # shapes like [q, prefix + q] are text, not rich markup
            fam.name, ", ".join(c.stages),
            "counts the root (q_len = budget)" if c.budget_counts_root else "drafts only (q_len = budget + 1)",
            c.topk_rule, c.padding, c.mask, c.summary)))
    Console(width=max(Console().width, 160)).print(t)


def _probe(path: Path) -> int:
    from harness.ports.probe import ADAPTER_GUIDE, probe
    if not path.exists():
        typer.echo(f"ddcheck: error: --probe {path}: no such file or directory", err=True)
        return 2
    results = probe(path)
    for r in results:
        typer.echo(f"{r.family}: " + ("fits" if r.fits else f"does not fit: {r.reason}"))
    fitting = [r.family for r in results if r.fits]
    if fitting:
        typer.echo(f"run it with: ddcheck run --impl {fitting[0]}:{path}")
        return 0
    typer.echo(f"no family fits {path}: write an adapter for it ({ADAPTER_GUIDE}) and register it under the "
               "ddcheck.ports entry point")
    return 1
