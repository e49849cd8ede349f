"""`ddcheck report`: JSONL records in, one self-contained HTML file out."""
from __future__ import annotations

from pathlib import Path
from typing import List

import typer

from harness.cli import app
from harness.cli.common import fail_usage


@app.command()
def report(
    records: List[Path] = typer.Argument(..., metavar="RUN.jsonl...", help="records of run, sweep or gate"),
    out: Path = typer.Option(Path("reports/report.html"), "-o", "--out", help="the HTML file to write"),
) -> None:
    """Render records as one HTML file (no network: CSS, script and SVG inline); exit 0, or 2 on bad input."""
    from harness.report.html import write_report
    from harness.report.model import ReportInputError
    try:
        write_report(records, out)
    except ReportInputError as e:
        fail_usage(e)
    typer.echo(f"report: {out}")
