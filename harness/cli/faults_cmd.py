"""`ddcheck faults`: the fault catalog; `--check` runs the self-test.

Layer: cli. Imports any layer below it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from harness.cli.app import app
from harness.cli.common import USAGE_ERRORS, check_outputs, fail_usage, pick_device, take_or_fail, write_text_atomic
from harness.check.outputs import OutputClaim, check_not_inputs


MAX_SEEDS = 1000   # seeds of the self-check's fault-free matrix, or per fault


def _flags(s) -> str:
    parts = [f"--budget {s.budget}", f"--topk {s.topk}", f"--batch {s.batch}", f"--backend {s.backend}",
             f"--seed {s.seed}", f"--max-new-tokens {s.max_new_tokens}"]
    parts += [f"--page-size {s.page_size}"] if s.page_size != 1 else []
    return " ".join((["--cuda-graph"] if s.cuda_graph else []) + parts)


@app.command()
def faults(
    check: bool = typer.Option(False, "--check", help="run every fault where it can show, and the fault-free matrix"),
    seeds: Optional[int] = typer.Option(None, help=f"seeds of the fault-free matrix (--check; default 5, at most "
                                        f"{MAX_SEEDS})"),
    fault_seeds: Optional[int] = typer.Option(None, help=f"seeds each fault runs under (--check; default 1, at most "
                                              f"{MAX_SEEDS})"),
    quick: bool = typer.Option(False, help="short runs (--max-new-tokens 10) and a smaller fault-free matrix"),
    backend: str = typer.Option("torch", help="backend of the self-check (faults that need another get theirs)"),
    only: Optional[list[str]] = typer.Option(None, "--fault", help="check only these faults (repeatable)"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the --check table as JSON"),
    device: str = typer.Option("auto", help="auto, cpu or cuda"),
    impl: Optional[str] = typer.Option(None, help="check with a port under test (FAMILY:PATH): faults on the stages "
                                       "that stay ddcheck's, the fault-free matrix through the port"),
) -> None:
    """List the fault catalog; with --check, prove each is detected and named. Exit 1 on a miss or false alarm."""
    from harness.faults.registry import catalog
    if not check:   # options of the self-check alone would be silently ignored: a usage error instead
        given = {"--seeds": seeds is not None, "--fault-seeds": fault_seeds is not None, "--quick": quick,
                 "--json": json_out is not None, "--impl": impl is not None, "--device": device != "auto",
                 "--backend": backend != "torch"}
        first = next((flag for flag, on in given.items() if on), None)
        if first:
            fail_usage(ValueError(f"{first} only applies to the self-check: add --check"))
    seeds, fault_seeds = 5 if seeds is None else seeds, 1 if fault_seeds is None else fault_seeds
    cat = catalog()
    unknown = [n for n in only or [] if n not in cat]
    if unknown:   # with or without --check: a name that is no fault is a usage error, never an empty pass
        fail_usage(ValueError(f"unknown fault {unknown[0]!r}; `ddcheck faults` lists them"))
    if not check:
        t = Table(title="fault catalog (ddcheck run --fault NAME)")
        for col in ("fault", "shows when", "breaks", "class", "source"):
            t.add_column(col, overflow="fold")
        for f in cat.values():
            if not only or f.name in only:
                t.add_row(f.name, f.shows_when, f.breaks, f.expected_class, f.source or "-")
        Console().print(t)
        return
    for flag, n in (("--seeds", seeds), ("--fault-seeds", fault_seeds)):
        if not 1 <= n <= MAX_SEEDS:
            fail_usage(ValueError(f"{flag} must be in [1, {MAX_SEEDS}], got {n}"))
    try:
        check_outputs(json=json_out)
        if impl:
            from harness.ports.import_check import check_port_imports
            from harness.ports.registry import parse_impl
            impl = parse_impl(impl).label
            check_not_inputs({"--json": json_out}, [("--impl", Path(impl.partition(":")[2]))])
            check_port_imports([impl])
    except USAGE_ERRORS as e:
        fail_usage(e)
    from harness.workflows.fault_selftest import self_check
    rows = []
    with OutputClaim("faults --check", 0, json=json_out) as claim:
        take_or_fail(claim)
        try:
            from harness.workflows.fault_selftest import CLEAN_MATRIX, CLEAN_QUICK
            total = len(only or cat) * fault_seeds + seeds * len(CLEAN_QUICK if quick else CLEAN_MATRIX)
            for n, row in enumerate(self_check(backend, seeds, quick, fault_seeds, only, device=pick_device(device),
                                               impl=impl), 1):
                # progress, one unwrapped line per run as it finishes (a CI log shows it live)
                if row is None:
                    typer.echo(f"[{n}/{total}] skip: the port cannot run this setting, or replaces the stage the "
                               "fault swaps, or --tp ranks cannot run here", err=True)
                    continue
                rows.append(row)
                typer.echo(f"[{n}/{total}] {row.fault or 'fault-free'} seed {row.settings.seed}: "
                           f"{'ok' if row.ok else 'FAIL'} ({row.seconds:.1f}s)", err=True)
        except USAGE_ERRORS as e:
            fail_usage(e)
        _print_table(rows)
        if json_out:
            write_text_atomic(json_out, json.dumps([_row_dict(r) for r in rows], indent=1))
    raise typer.Exit(0 if all(r.ok for r in rows) else 1)


def _row_dict(r) -> dict:
    return {"fault": r.fault, "settings": _flags(r.settings), "detected": r.detected, "fault_class": r.fault_class,
            "expected_class": r.expected_class, "ok": r.ok, "seconds": round(r.seconds, 2)}


def _print_table(rows) -> None:
    t = Table(title="ddcheck faults --check")
    for col in ("fault", "detected", "named correctly", "settings", "time"):
        t.add_column(col, overflow="fold")
    for r in rows:
        if r.fault is None:
            continue
        named = f"[green]yes[/] ({r.fault_class})" if r.named else f"[red]no[/] ({r.fault_class} != {r.expected_class})"
        t.add_row(r.fault, "[green]yes[/]" if r.detected else "[red]MISSED[/]", named, _flags(r.settings),
                  f"{r.seconds:.1f}s")
    clean = [r for r in rows if r.fault is None]
    alarms = [r for r in clean if r.detected]
    seeds = sorted({r.settings.seed for r in clean})
    t.add_row("fault-free matrix", f"[red]{len(alarms)} false alarms[/]" if alarms else "[green]0 false alarms[/]",
              f"{len(clean)} runs", f"seeds {seeds[0]}..{seeds[-1]}" if seeds else "", 
              f"{sum(r.seconds for r in clean):.1f}s")
    for r in alarms:
        t.add_row("  false alarm", _flags(r.settings), r.fault_class or "", "", f"{r.seconds:.1f}s")
    Console().print(t)
