"""`ddcheck sweep`: a setting matrix from comma-list flags or a case file,
settings spread over a process pool, one JSONL, a summary table."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from harness.cli import app
from harness.cli.common import USAGE_ERRORS, fail_usage, pick_backend, pick_device
from harness.runner.settings import DEFAULT_PROMPTS, RunSettings, UsageError
from harness.sweep import SettingJob, SettingResult, default_jobs, run_jobs, summary_frame, validate, write_jsonl

_BOOLS = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}


def parse_list(flag: str, raw: str, kind) -> tuple:
    """'4,8,16' -> (4, 8, 16); a usage error names the flag."""
    items = [x.strip() for x in raw.split(",") if x.strip()]
    if not items:
        raise UsageError(f"{flag}: expected a comma list, got {raw!r}")
    try:
        if kind is bool:
            return tuple(dict.fromkeys(_BOOLS[x.lower()] for x in items))
        return tuple(dict.fromkeys(kind(x) for x in items))
    except (KeyError, ValueError):
        what = "on/off values" if kind is bool else f"{kind.__name__} values"
        raise UsageError(f"{flag}: expected a comma list of {what}, got {raw!r}") from None


def run_with_progress(jobs: list[SettingJob], n_jobs: int, title: str) -> list[SettingResult]:
    """Run the jobs; a progress bar and one line per finished setting on stderr."""
    console = Console(stderr=True)
    with Progress(TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(), TextColumn("settings"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(title, total=len(jobs))

        def done(job: SettingJob, r: SettingResult) -> None:
            mark = "[red]error[/]" if r.usage_error else "[green]pass[/]" if r.passed else "[red]DIVERGE[/]"
            bar.console.print(f"{mark} {job.case}/{job.label or '-'} {job.short} ({r.wall_s:.1f} s)",
                              highlight=False, markup=True)
            bar.advance(task)
        return run_jobs(jobs, n_jobs, done)


def print_frame(jobs: list[SettingJob], results: list[SettingResult]) -> None:
    """The pandas summary, one row per setting, compact enough for a CI log."""
    df = summary_frame(jobs, results)
    df["setting"] = [f"{j.case}/{j.short}" for j in jobs]
    cols = ["#", "setting", "nodes", "divergent", "max_rel_err", "first_divergence", "verdict", "seconds"]
    t = Table(title="sweep summary")
    for c in cols:
        t.add_column(c, overflow="fold", no_wrap=c != "first_divergence")
    colours = {"pass": "green", "DIVERGE": "red", "error": "red"}
    for row in df[cols].itertuples(index=False):
        cells = dict(zip(cols, map(str, row)))
        err = row[cols.index("max_rel_err")]  # a float, or "inf" as the records write it
        cells["max_rel_err"] = f"{err:.1e}" if isinstance(err, (int, float)) else str(err)
        cells["verdict"] = f"[{colours[cells['verdict']]}]{cells['verdict']}[/]"
        t.add_row(*cells.values())
    Console(width=max(Console().width, 140)).print(t)


def first_usage_error(results: list[SettingResult]) -> str | None:
    return next((f"{r.usage_error} (setting: {r.setting})" for r in results if r.usage_error), None)


@app.command()
def sweep(
    budget: Optional[str] = typer.Option(None, help="comma list, e.g. 4,8,16 (default 16)"),
    topk: Optional[str] = typer.Option(None, help="comma list (default 1)"),
    cuda_graph: Optional[str] = typer.Option(None, "--cuda-graph", help="comma list of on/off (default off)"),
    backend: Optional[str] = typer.Option(None, help="comma list: torch, sglang-triton (default as in run)"),
    batch: Optional[str] = typer.Option(None, help="comma list (default 1)"),
    dtype: Optional[str] = typer.Option(None, help="comma list (default float32)"),
    case: Optional[Path] = typer.Option(None, help="take model, prompts and matrix from a case file instead"),
    fault: Optional[str] = typer.Option(None, help="switch a fault on wherever it can show"),
    max_new_tokens: int = typer.Option(24), block_size: int = typer.Option(8),
    model: str = typer.Option("tiny"), seed: int = typer.Option(0),
    accept: str = typer.Option("walk"), device: str = typer.Option("auto"),
    jobs: int = typer.Option(0, help="worker processes (default: one per core)"),
    out: Path = typer.Option(Path("reports/sweep.jsonl"), help="one JSONL for the whole sweep"),
    html: Optional[Path] = typer.Option(None, help="also write a self-contained HTML report"),
) -> None:
    """Check every setting of a matrix; exit 0 all match, 1 any divergence, 2 usage."""
    try:
        job_list = _plan(locals())
        validate(job_list)
    except USAGE_ERRORS as e:
        fail_usage(e)
    results = run_with_progress(job_list, jobs or default_jobs(), "sweep")
    err = first_usage_error(results)
    if err:
        fail_usage(UsageError(err))
    write_jsonl(results, out)
    print_frame(job_list, results)
    typer.echo(f"records: {out}")
    if html:
        from harness.report.html import write_report
        write_report([out], html)
        typer.echo(f"report: {html}")
    raise typer.Exit(0 if all(r.passed for r in results) else 1)


def _plan(a: dict) -> list[SettingJob]:
    from harness.cases import Matrix, load_case
    from harness.faults import why_cannot_show
    flags = {k: a[k] for k in ("budget", "topk", "cuda_graph", "backend", "batch", "dtype") if a[k] is not None}
    if a["jobs"] < 0:
        raise UsageError(f"--jobs must be >= 0, got {a['jobs']}")
    if a["case"] is not None:
        if flags:
            raise UsageError(f"--case and matrix flags (--{', --'.join(flags)}) are exclusive")
        c = load_case(a["case"])
        settings = [(s, m.label) for m in c.matrix for s in m.settings(c.base)]
        prompts, name, vocab = c.prompts, c.name, None
    else:
        kinds = {"budget": int, "topk": int, "cuda_graph": bool, "backend": str, "batch": int, "dtype": str}
        axes = {k: parse_list(f"--{k.replace('_', '-')}", v, kinds[k]) for k, v in flags.items()}
        axes.setdefault("backend", (pick_backend(None),))
        base = RunSettings(max_new_tokens=a["max_new_tokens"], block_size=a["block_size"], model=a["model"],
                           seed=a["seed"], accept=a["accept"], device=pick_device(a["device"]))
        from harness.cases import AXIS_DEFAULTS
        full = {k: axes.get(k, AXIS_DEFAULTS[k]) for k in AXIS_DEFAULTS}
        settings = [(s, "flags") for s in Matrix("flags", full, None, a["accept"]).settings(base)]
        prompts, name = DEFAULT_PROMPTS, "sweep"
    if a["fault"]:
        from harness.cases import model_vocab
        vocab = model_vocab(settings[0][0].model)
        shown = [(replace_fault(s, a["fault"]), label) for s, label in settings
                 if not why_cannot_show(a["fault"], s, vocab)]
        if not shown:
            raise UsageError(why_cannot_show(a["fault"], settings[0][0], vocab))
        settings = shown
    return [SettingJob(i, s, prompts, name, label) for i, (s, label) in enumerate(settings)]


def replace_fault(s: RunSettings, fault: str) -> RunSettings:
    from dataclasses import replace
    return replace(s, fault=fault)
