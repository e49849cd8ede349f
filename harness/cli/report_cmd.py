"""`ddcheck report`: JSONL records in, one self-contained HTML file out.

Layer: cli. Imports any layer below it."""
from __future__ import annotations

from pathlib import Path
from typing import List

import typer

from harness.cli.app import app
from harness.cli.common import USAGE_ERRORS, check_outputs, fail_usage
from harness.check.outputs import check_not_inputs


@app.command()
def report(
    records: List[Path] = typer.Argument(..., metavar="RUN.jsonl...", help="records of run, sweep or gate"),
    out: Path = typer.Option(Path("reports/report.html"), "-o", "--out", help="the HTML file to write"),
) -> None:
    """Render records as one HTML file (no network: CSS, script and SVG inline). Exit 0 when every run
    passed, 1 when one diverged, missed an expected fault or is incomplete (no summary), 2 on bad input."""
    from harness.report.html import write_report
    from harness.report.model import BAD_STATUSES, ReportInputError
    try:
        check_outputs(out=out)
        check_not_inputs({"--out": out}, [("records file", r) for r in records])
        views = write_report(records, out)
    except (ReportInputError, *USAGE_ERRORS) as e:
        fail_usage(e)
    bad = [v for v in views if v.status in BAD_STATUSES or v.status == "incomplete"]
    incomplete = sum(v.status == "incomplete" for v in bad)
    typer.echo(f"report: {out}: {len(views)} runs, {len(bad) - incomplete} failing, {incomplete} incomplete")
    raise typer.Exit(1 if bad else 0)
