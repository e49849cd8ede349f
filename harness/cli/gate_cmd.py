"""`ddcheck gate`, the CI gate before a deploy, and `ddcheck cases`.

Layer: cli. Imports any layer below it."""
from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from harness.cli.app import app
from harness.cli.common import USAGE_ERRORS, check_jobs, check_outputs, fail_usage, take_or_fail, write_text_atomic
from harness.check.outputs import OutputClaim, check_not_inputs
from harness.engine.settings import UsageError


@app.command()
def cases(directory: Path = typer.Option(Path("cases"), help="where the case files live")) -> None:
    """List the case files, one line each (a malformed one is an error, exit 2)."""
    from harness.workflows.cases import discover, load_case
    paths = discover(directory)
    if not paths:
        fail_usage(UsageError(f"no case files (*.toml) in {directory}"))
    try:
        loaded = [load_case(p) for p in paths]
    except USAGE_ERRORS as e:
        fail_usage(e)
    for c in loaded:
        typer.echo(c.one_line())


@app.command()
def gate(
    case_files: Optional[List[Path]] = typer.Argument(None, metavar="[CASE]...", help="case files (default cases/gate.toml)"),
    fault: Optional[str] = typer.Option(None, help="switch a fault on over every matrix setting where it can show"),
    jobs: int = typer.Option(0, "--jobs", "--workers", help="settings at once: worker processes, or a local Ray "
                             "cluster's CPUs (default: one per core)"),
    executor: str = typer.Option("local", help="where settings run: local (a process pool) or ray"),
    ray_address: Optional[str] = typer.Option(None, help="with --executor ray: an existing cluster (default: "
                                              "a local one)"),
    junit: Optional[Path] = typer.Option(None, help="write JUnit XML (one testcase per setting and expected fault)"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write a JSON summary"),
    out: Path = typer.Option(Path("reports/gate.jsonl"), help="the records of every setting"),
    html: Optional[Path] = typer.Option(None, help="also write a self-contained HTML report"),
    device: str = typer.Option("auto", help="auto, cpu or cuda: where every setting runs"),
    impl: Optional[List[str]] = typer.Option(None, help="a port under test, FAMILY:PATH, over every case "
                                             "(repeatable; a case's own `impl` otherwise)"),
) -> None:
    """Run the cases: exit 0 all pass, 1 a divergence or an expected fault not caught, 2 usage/environment."""
    from harness.workflows.cases import DEFAULT_CASE, load_case
    from harness.cli.sweep_cmd import executor_spec, pick_case_device, print_results, run_or_exit
    from harness.workflows.gate import ci_line, gate_line, json_summary, judge, junit_xml, plan
    from harness.faults.registry import catalog
    from harness.workflows.sweep import (default_jobs, exit_code, job_inputs, on_device, port_error_lines,
                                         unjudged_lines, validate, with_impls, write_jsonl)
    t0 = time.perf_counter()
    try:
        check_outputs(out=out, junit=junit, json=json_out, html=html)
        check_jobs(jobs)
        spec = executor_spec(executor, jobs, ray_address)
        if fault is not None and fault not in catalog():
            raise UsageError(f"unknown fault {fault!r}; `ddcheck faults` lists them")
        on = pick_case_device(device)
        loaded = [load_case(p) for p in (case_files or [DEFAULT_CASE])]
        job_list = with_impls(on_device(plan(loaded, fault), on), impl)
        validate(job_list)
        check_not_inputs({"--out": out, "--junit": junit, "--json": json_out, "--html": html},
                         job_inputs(job_list, *(c.path for c in loaded)))
    except USAGE_ERRORS as e:
        fail_usage(e)
    with OutputClaim("gate", len(job_list), out=out, junit=junit, json=json_out, html=html) as claim:
        take_or_fail(claim)
        results = run_or_exit(job_list, jobs or default_jobs(), "gate", out, spec)
        wall = time.perf_counter() - t0
        verdicts = judge(job_list, results)
        write_jsonl(results, out)
        for path, text in ((junit, junit_xml(verdicts, wall) if junit else ""),
                           (json_out, json_summary(loaded, verdicts, wall, str(out)) if json_out else "")):
            if path:
                write_text_atomic(path, text)
        failed = [v for v in verdicts if not v.passed]
        print_results(job_list, results, "gate", [ci_line(v) for v in failed], out)
        if Console().is_terminal:
            for v in failed:
                typer.echo(f"FAIL {v.case} / {v.name}: {v.message}\n     reproduce: {v.setting}")
        if html:
            from harness.report.html import write_report
            write_report([out], html)
    typer.echo(gate_line(verdicts, wall, jobs or default_jobs(), out))
    for line in unjudged_lines(results) + port_error_lines(results):
        typer.echo(line, err=True)
    raise typer.Exit(exit_code(results, bool(failed)))
