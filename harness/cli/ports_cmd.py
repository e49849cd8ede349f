"""`ddcheck ports`: the port families and their conventions.

Layer: cli. Imports any layer below it."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from harness.cli.app import app


@app.command()
def ports() -> None:
    """List the DDTree port families `--impl FAMILY:PATH` can drive, with their conventions."""
    from harness.ports.registry import families
    t = Table(title="port families (ddcheck run --impl FAMILY:PATH)", show_lines=True)
    for col in ("family", "stages", "budget", "topk", "padding rows", "mask", "code"):
        t.add_column(col, overflow="fold")
    for fam in families().values():
        c = fam.describe() if fam.describe else None
        if c is None:
            t.add_row(fam.name, "?", "?", "?", "?", "?", "(conventions known once loaded)")
            continue
        t.add_row(fam.name, ", ".join(c.stages),
                  "counts the root (q_len = budget)" if c.budget_counts_root else "drafts only (q_len = budget + 1)",
                  c.topk_rule, c.padding, c.mask, c.summary)
    Console(width=max(Console().width, 160)).print(t)
