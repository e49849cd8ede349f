"""`ddcheck calibrate CASE`: measure the fault-free error distribution of a
case's settings and write the tolerances it supports into the case file.

Layer: cli. Imports any layer below it."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from harness.cli.app import app
from harness.cli.common import USAGE_ERRORS, check_outputs, fail_usage
from harness.check.outputs import check_not_inputs, refuse_unsafe
from harness.engine.settings import UsageError


@app.command()
def calibrate(
    case: Path = typer.Argument(..., help="the case file whose fault-free matrix is measured (and rewritten)"),
    model: Optional[str] = typer.Option(None, help="measure this model instead of the case's (preset or checkpoint)"),
    out: Optional[Path] = typer.Option(None, help="write the calibrated case here (default: the case file itself)"),
    leaks: bool = typer.Option(True, "--leaks/--no-leaks", help="run the one-key leaks under the calibrated rule "
                               "before writing it (bf16/fp16 settings)"),
    require_leaks_caught: bool = typer.Option(False, help="write nothing and exit 1 when the rule lets a one-key "
                                              "leak pass (default: write it, with the uncaught leaks named)"),
) -> None:
    """Run the case's fault-free settings, print the per-dtype error distribution
    and write [tolerances] (a noise floor for bf16/fp16, a fixed one for float32)."""
    from dataclasses import replace
    from harness.workflows.calibrate import calibration_settings, measure, write_tolerances
    from harness.workflows.cases import load_case, prompts_for
    from harness.workflows.sweep import SettingJob, job_inputs
    err = Console(stderr=True)
    try:
        check_outputs(out=out)
        refuse_unsafe("CASE", case)   # rewritten in place when no --out is given
        c = load_case(case)
        settings = calibration_settings(c)
        if model is not None:
            settings = [replace(s, model=model) for s in settings]
        if not settings:
            raise UsageError(f"calibrate: {case} has no fault-free setting to measure")
        check_not_inputs({"--out": out}, job_inputs([SettingJob(0, s) for s in settings]))
        from harness.check.prepare import prepare
        prepare(settings[0], prompts_for(settings[0]))   # bad model input is a usage error before any measuring
    except USAGE_ERRORS as e:
        fail_usage(e)
    result = measure(settings, lambda i, s, summ: err.print(
        f"[{i + 1}/{len(settings)}] {s.dtype} b{s.budget} k{s.topk} bs{s.batch}: {summ.nodes_checked} nodes, "
        f"max err {summ.max_rel_err:.2e}" + (f", max ratio {summ.max_noise_ratio:.2f}" if summ.max_noise_ratio else "")))
    t = Table(title=f"calibration of {case}")
    for col in ("dtype", "settings", "nodes", "p99 error", "max error", "max e/e_twin", "written"):
        t.add_column(col)
    for r in result:
        t.add_row(r.dtype, str(r.settings), str(r.nodes), f"{r.p99_rel_err:.2e}", f"{r.max_rel_err:.2e}",
                  "-" if r.max_noise_ratio is None else f"{r.max_noise_ratio:.2f}", r.toml())
    Console().print(t)
    if any(r.failed for r in result):
        typer.echo("calibrate: some fault-free settings diverged under the default rule; nothing written "
                   "(a divergence is not noise: run them and look)", err=True)
        raise typer.Exit(1)
    notes = _prove_leaks(settings, result, err) if leaks else []
    missed = [line for line in notes if "NOT CAUGHT" in line]
    if missed and require_leaks_caught:
        typer.echo(f"calibrate: the rule lets {len(missed)} leak run(s) pass; nothing written "
                   "(--require-leaks-caught):\n" + "\n".join(missed), err=True)
        raise typer.Exit(1)
    target = out or case
    write_tolerances(case, result, target, notes)
    typer.echo(f"wrote [tolerances] to {target}" + (f"; {len(missed)} leak run(s) NOT caught under it, named "
                                                    "there" if missed else ""))


def _prove_leaks(settings, result, err: Console) -> list[str]:
    """The one-key leaks under the rules about to be written; printed as a table, returned as case-file notes."""
    from harness.workflows.calibrate import noise_rules
    from harness.workflows.calibrate_leaks import case_comment, prove_leaks
    rules = noise_rules(result)
    if not rules:
        return []
    proofs = prove_leaks(settings, rules, on_run=lambda p: err.print(
        f"leak {p.leak} {p.dtype} ({p.setting}): " + ("not exercised" if not p.exercised else
                                                    "caught" if p.caught else "NOT CAUGHT")))
    t = Table(title="one-key leaks under the calibrated rule")
    for col in ("dtype", "leak", "setting", "mask entries", "verdict", "max ratio", "multiplier"):
        t.add_column(col)
    for p in proofs:
        t.add_row(p.dtype, p.leak, p.setting, str(p.edited),
                  "not exercised" if not p.exercised else f"caught ({p.by})" if p.caught else "NOT CAUGHT",
                  "-" if p.max_ratio is None else f"{p.max_ratio:.2f}", f"{p.multiplier:.3g}")
    Console().print(t)
    return case_comment(proofs)
