"""`ddcheck sweep`: a setting matrix from comma-list flags or a case file,
settings spread over a process pool, one JSONL, a summary table.

Layer: cli. Imports any layer below it."""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import List, NoReturn, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from harness.cli.app import app
from harness.cli.common import (USAGE_ERRORS, check_jobs, check_outputs, fail_usage, pick_backend, pick_device,
                                 take_or_fail)
from harness.check.outputs import OutputClaim, RecordStream, check_not_inputs
from harness.engine.settings import RunSettings, UsageError
from harness.report.model import describe_first
from harness.workflows.executors import ExecutorSpec, make_executor
from harness.workflows.sweep import (SettingJob, SettingResult, default_jobs, job_inputs, run_jobs, short_label, summary_frame,
                           validate, unjudged_lines, verdict, with_impls, write_jsonl,
                           exit_code, port_error_lines)

# the summary table's verdicts (harness.workflows.sweep.verdict); caught is an expected fault, not a failure
VERDICT_COLOURS = {"pass": "green", "caught": "cyan", "skip": "yellow", "DIVERGE": "red", "MISSED": "red",
                   "error": "red", "internal-error": "red", "oracle-crash": "red", "port-error": "red"}
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


def run_with_progress(jobs: list[SettingJob], n_jobs: int, title: str,
                      stream: RecordStream | None = None, executor: ExecutorSpec | None = None) -> list[SettingResult]:
    """Run the jobs; a progress bar and one line per finished setting on
    stderr, each finished setting's records appended to `stream` at once."""
    console = Console(stderr=True)
    with Progress(TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(), TextColumn("settings"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(title, total=len(jobs))

        def done(job: SettingJob, r: SettingResult) -> None:
            if stream is not None:
                stream.add(r.lines)
            v = verdict(job, r)
            bar.console.print(f"[{VERDICT_COLOURS[v]}]{v}[/] {job.case}/{job.label or '-'} {short_label(job.settings)} "
                              f"({r.wall_s:.1f} s)",
                              highlight=False, markup=True, soft_wrap=True)
            bar.advance(task)
        return run_jobs(jobs, n_jobs, done, executor=executor)


def one_line(text: str) -> str:
    """A record's sentence on one log line."""
    return " ".join(str(text).split())


def print_results(jobs: list[SettingJob], results: list[SettingResult], title: str,
                  failures: list[tuple[str, str]] | None = None, records: Path | None = None) -> None:
    """On a terminal, the table; in a CI log (no terminal) a tally line and,
    per failed setting, two lines of at most 80 columns: verdict, case/label
    and setting, then the class the localizer named and the first divergence
    (`failures`: the gate's own pairs instead); then the command that shows
    each in full (explanation, reproduce command)."""
    from harness.workflows.gate import fit
    if Console().is_terminal:
        print_frame(jobs, results, title)
        return
    verdicts = [verdict(j, r) for j, r in zip(jobs, results)]
    tally = {v: verdicts.count(v) for v in dict.fromkeys(verdicts)}
    typer.echo(f"{title}: {len(jobs)} settings: " + ", ".join(f"{n} {v}" for v, n in tally.items()))
    if failures is None:
        failures = []
        for j, r, v in zip(jobs, results, verdicts):
            if v in ("pass", "caught", "skip"):
                continue
            named = r.summary.get("fault_class")
            failures.append((f"{v} {j.case}/{j.label or '-'} {short_label(j.settings)}",
                             (f"{named}: " if named else "") + (r.usage_error or describe_first(r.summary))))
    for head, detail in failures:
        typer.echo(fit(one_line(head)))
        typer.echo(fit("    " + one_line(detail)))
    if failures and records is not None:
        typer.echo(f"{title}: each failure in full, with its reproduce command: ddcheck report {records}")


def print_frame(jobs: list[SettingJob], results: list[SettingResult], title: str = "sweep") -> None:
    """The pandas summary, one row per setting (on a terminal)."""
    df = summary_frame(jobs, results)
    df["setting"] = [f"{j.case}/{short_label(j.settings)}" for j in jobs]
    cols = ["#", "setting", "nodes", "divergent", "max_rel_err", "accepted", "first_divergence", "verdict", "seconds"]
    t = Table(title=f"{title} summary")
    for c in cols:
        t.add_column(c, overflow="fold", no_wrap=c != "first_divergence", min_width=7 if c == "verdict" else None)
    for row in df[cols].itertuples(index=False):
        cells = dict(zip(cols, map(str, row)))
        err = row[cols.index("max_rel_err")]  # a float, or "inf" as the records write it
        cells["max_rel_err"] = f"{err:.1e}" if isinstance(err, (int, float)) else str(err)
        accepted = row[cols.index("accepted")]  # mean accepted length, None when no step ran
        cells["accepted"] = f"{accepted:.2f}" if isinstance(accepted, float) and accepted == accepted else "-"
        cells["verdict"] = f"[{VERDICT_COLOURS[cells['verdict']]}]{cells['verdict']}[/]"
        t.add_row(*cells.values())
    Console(width=max(Console().width, 140)).print(t)
    if "caught" in set(df["verdict"]):
        Console().print(f"[{VERDICT_COLOURS['caught']}]caught[/]: an expected fault diverged and was named as its "
                        "catalog entry says (not a failure); [red]MISSED[/]: it was not", highlight=False)


def leave_after_interrupt(code: int, grace_s: float = 10.0) -> NoReturn:
    """Exit with `code`, everything written. The process pool's manager
    thread, left with terminated workers, is given `grace_s` to wind down;
    the interpreter's exit would join it without a limit, and that join can
    block for good (a fresh-clone CI run on 2 loaded cores hung there after
    printing the interrupted line), so past the grace the exit skips it."""
    import threading
    import time
    sys.stdout.flush()
    sys.stderr.flush()
    deadline = time.monotonic() + grace_s
    others = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    for t in others:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in others):
        os._exit(code)
    raise typer.Exit(code)


def run_or_exit(jobs: list[SettingJob], n_jobs: int, title: str, out: Path | None = None,
                executor: ExecutorSpec | None = None) -> list[SettingResult]:
    """Run every setting, each one's records appended to `out` as it finishes
    (after the `started` placeholder OutputClaim wrote: a run killed after N
    settings leaves their N summaries, in a file a report shows incomplete);
    a usage error met inside a worker is exit 2. Ctrl-C: the finished
    settings' records go to `out` with an `interrupted` record (a report shows
    the file as incomplete), one line says what finished, exit 130. The
    finished file replaces the stream atomically (write_jsonl)."""
    from harness.workflows.sweep import Interrupted
    stream = RecordStream(out)
    try:
        results = run_with_progress(jobs, n_jobs, title, stream, executor)
    except Interrupted as e:
        stream.close()
        if out is not None:
            write_jsonl(e.finished, out, interrupted=(len(e.finished), e.total))
        typer.echo(f"{title}: interrupted: {len(e.finished)} of {e.total} settings finished"
                   + (f"; their records in {out} (incomplete)" if out is not None else ""), err=True)
        leave_after_interrupt(130)
    finally:
        stream.close()
    err = next((f"{r.usage_error} (setting: {r.setting})" for r in results if r.usage_error), None)
    if err:
        fail_usage(UsageError(err))
    return results


# flags a case file sets itself: with --case they must keep their defaults
CASE_OWNED = {"max_new_tokens": 24, "block_size": 8, "model": "tiny", "seed": 0, "accept": "walk", "drafter": "auto",
              "draft_layers": None}


@app.command()
def sweep(
    budget: Optional[str] = typer.Option(None, help="comma list, e.g. 4,8,16 (default 16)"),
    topk: Optional[str] = typer.Option(None, help="comma list (default 1)"),
    cuda_graph: Optional[str] = typer.Option(None, "--cuda-graph", help="comma list of on/off (default off)"),
    backend: Optional[str] = typer.Option(None, help="comma list: torch, sglang-triton (default as in run)"),
    batch: Optional[str] = typer.Option(None, help="comma list (default 1)"),
    dtype: Optional[str] = typer.Option(None, help="comma list (default float32)"),
    page_size: Optional[str] = typer.Option(None, help="comma list of KV page sizes, e.g. 1,16,64 (default 1)"),
    tp: Optional[str] = typer.Option(None, help="comma list of tensor-parallel rank counts, e.g. 1,2,4 (default 1)"),
    sliding_window: Optional[str] = typer.Option(None, help="comma list of windows, 0 for none (default 0)"),
    case: Optional[Path] = typer.Option(None, help="take model, prompts and matrix from a case file instead"),
    fault: Optional[str] = typer.Option(None, help="switch a fault on wherever it can show"),
    max_new_tokens: int = typer.Option(CASE_OWNED["max_new_tokens"]),
    block_size: int = typer.Option(CASE_OWNED["block_size"]),
    model: str = typer.Option(CASE_OWNED["model"]), seed: int = typer.Option(CASE_OWNED["seed"]),
    accept: str = typer.Option(CASE_OWNED["accept"]),
    drafter: str = typer.Option(CASE_OWNED["drafter"], help="noisy, self or auto (as in run)"),
    draft_layers: Optional[int] = typer.Option(CASE_OWNED["draft_layers"], help="the self-draft's k (as in run)"),
    device: str = typer.Option("auto", help="auto, cpu or cuda (with --case: applied to every setting)"),
    jobs: int = typer.Option(0, "--jobs", "--workers", help="settings at once: worker processes, or a local Ray "
                             "cluster's CPUs (default: one per core)"),
    executor: str = typer.Option("local", help="where settings run: local (a process pool) or ray"),
    ray_address: Optional[str] = typer.Option(None, help="with --executor ray: an existing cluster (default: "
                                              "a local one)"),
    out: Path = typer.Option(Path("reports/sweep.jsonl"), help="one JSONL for the whole sweep"),
    html: Optional[Path] = typer.Option(None, help="also write a self-contained HTML report"),
    impl: Optional[List[str]] = typer.Option(None, help="a port under test, FAMILY:PATH (repeatable: an axis)"),
    port_stages: Optional[str] = typer.Option(None, help="with --impl: which of the port's stages to use"),
) -> None:
    """Check every setting of a matrix; exit 0 all match, 1 any divergence, 2 usage."""
    try:
        check_outputs(out=out, html=html)
        check_jobs(jobs)
        spec = executor_spec(executor, jobs, ray_address)
        matrix_flags = {"budget": budget, "topk": topk, "cuda_graph": cuda_graph, "backend": backend,
                        "batch": batch, "dtype": dtype, "sliding_window": sliding_window, "page_size": page_size,
                        "tp": tp}
        run_flags = {"max_new_tokens": max_new_tokens, "block_size": block_size, "model": model, "seed": seed,
                     "accept": accept, "drafter": drafter, "draft_layers": draft_layers}
        if case is not None:
            job_list = plan_case(case, matrix_flags, run_flags, device, fault)
        else:
            job_list = plan_flags(matrix_flags, run_flags, device, fault)
        job_list = with_impls(job_list, impl, port_stages)
        validate(job_list)
        check_not_inputs({"--out": out, "--html": html}, job_inputs(job_list, case))
    except USAGE_ERRORS as e:
        fail_usage(e)
    with OutputClaim("sweep", len(job_list), out=out, html=html) as claim:
        take_or_fail(claim)
        results = run_or_exit(job_list, jobs or default_jobs(), "sweep", out, spec)
        write_jsonl(results, out)
        print_results(job_list, results, "sweep", records=out)
        if html:
            from harness.report.html import write_report
            write_report([out], html)
            typer.echo(f"report: {html}")
    unjudged, port_errors = unjudged_lines(results), port_error_lines(results)
    for line in unjudged + port_errors:
        typer.echo(line, err=True)
    failing = sum(not r.passed for r in results)
    state = "UNJUDGED" if unjudged else "PORT ERROR" if port_errors else "PASS" if not failing else "FAIL"
    typer.echo(f"sweep: {state}: {len(results)} settings, {failing} failing; records {out}")
    raise typer.Exit(exit_code(results, failing > 0))


def executor_spec(name: str, jobs: int, ray_address: str | None) -> ExecutorSpec:
    """--executor, --workers/--jobs and --ray-address as a spec; a usage error
    (exit 2, before anything runs) when the executor's package is missing."""
    spec = ExecutorSpec(name, jobs or default_jobs(), ray_address)
    make_executor(spec)
    return spec


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def plan_case(case: Path, matrix_flags: dict, run_flags: dict, device: str, fault: str | None) -> list[SettingJob]:
    """A case file's matrix (each distinct setting once) on `device`. Matrix
    flags and the run flags the case sets itself are usage errors here."""
    from harness.workflows.cases import load_case
    given = [_flag(k) for k, v in matrix_flags.items() if v is not None]
    if given:
        raise UsageError(f"--case and matrix flags ({', '.join(given)}) are exclusive")
    for k, v in run_flags.items():
        if v != CASE_OWNED[k]:
            raise UsageError(f"{_flag(k)} cannot be combined with --case (the case file sets it)")
    on = pick_case_device(device)
    c = load_case(case)
    settings = [(replace(s, device=on), label) for s, label in c.labelled_settings()]
    return _jobs(settings, c.prompts_of, c.name, fault)


def plan_flags(matrix_flags: dict, run_flags: dict, device: str, fault: str | None) -> list[SettingJob]:
    """The product of the comma-list flags (omitted axes take their defaults)."""
    from harness.workflows.cases import AXIS_DEFAULTS, Matrix
    kinds = {"budget": int, "topk": int, "cuda_graph": bool, "backend": str, "batch": int, "dtype": str,
             "sliding_window": int, "page_size": int, "tp": int}
    axes = {k: parse_list(_flag(k), v, kinds[k]) for k, v in matrix_flags.items() if v is not None}
    if "backend" not in axes:   # the default backend imports SGLang to see whether it imports: only when needed
        axes["backend"] = (pick_backend(None),)
    base = RunSettings(**run_flags, device=pick_device(device))
    full = {k: axes.get(k, AXIS_DEFAULTS[k]) for k in AXIS_DEFAULTS}
    settings = [(s, "flags") for s in Matrix("flags", full, None, run_flags["accept"]).settings(base)]
    return _jobs(settings, lambda s: None, "sweep", fault)   # the runs' own prompts: text for a tokenizer's model


def _jobs(settings: list[tuple[RunSettings, str]], prompts_of, case_name: str, fault: str | None) -> list[SettingJob]:
    """Jobs in order, each with `prompts_of(setting)` (None: the run's own); with `fault`, only the settings
    where it can show, each with it switched on."""
    if fault:
        from harness.workflows.cases import model_vocab
        from harness.faults import why_cannot_show
        vocab = model_vocab(settings[0][0].model)
        shown = [(replace(s, fault=fault), label) for s, label in settings if not why_cannot_show(fault, s, vocab)]
        if not shown:
            raise UsageError(why_cannot_show(fault, settings[0][0], vocab))
        settings = shown
    return [SettingJob(i, s, prompts_of(s), case_name, label) for i, (s, label) in enumerate(settings)]


def pick_case_device(device: str) -> str:
    """--device for case files (which name none): auto, cpu or cuda."""
    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device must be auto, cpu or cuda, got {device!r}")
    return pick_device(device)
