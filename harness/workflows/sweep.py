"""Many settings, each one independent `check`, spread over an executor
(harness/workflows/executors: the local process pool by default, or Ray).

Workers start clean (spawned processes, Ray workers); on a machine
without CUDA the parent sets TRITON_INTERPRET=1 before spawning, so every
worker imports triton (SGLang's kernels, the acceptance cross-check) under
the interpreter. Each worker returns its setting's JSONL lines; the parent
writes them all to one file, in setting order, once every setting is done.


Layer: workflows. Imports report, the check and below; never cli."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from harness.check.records import RecordWriter
from harness.report.model import expected_fault_caught
from harness.workflows.executors.base import ExecutorSpec, make_executor
from harness.engine.settings import DEFAULT_PROMPTS, NotRunnableHere, PromptSpec, RunSettings, UsageError


@dataclass(frozen=True)
class SettingJob:
    index: int
    settings: RunSettings
    prompts: tuple[PromptSpec, ...] | None = DEFAULT_PROMPTS   # None: the run's own (text for a tokenizer's model)
    case: str = "sweep"
    label: str = ""                  # the matrix table or expected fault it came from
    expect_fault: str | None = None  # set when the gate expects this run to be caught
    acceptance: object | None = None  # an AcceptanceBaseline the run's mean accepted length must hold

    @property
    def cost(self) -> int:
        """Rough relative cost, to start the slow settings first."""
        slow_backend = 4 if self.settings.backend != "torch" else 1
        return self.settings.batch * (self.settings.budget + 1) * slow_backend


def short_label(s: RunSettings) -> str:
    """The matrix axes of a setting in one line (tables, progress lines, JUnit names)."""
    fault = f" +{s.fault}" if s.fault else ""
    port = f" [{s.impl.partition(':')[0]}]" if s.impl else ""
    page = f" page{s.page_size}" if s.page_size != 1 else ""
    window = f" swa{s.sliding_window}" if s.sliding_window is not None else ""
    tp = f" tp{s.tp}" if s.tp != 1 else ""
    return (f"b{s.budget} k{s.topk} graph-{'on' if s.cuda_graph else 'off'} {s.backend} bs{s.batch} "
            f"{s.dtype}{window}{page}{tp}{fault}{port}")


def with_impls(jobs: list[SettingJob], impls: list[str] | None, port_stages: str | None = None) -> list[SettingJob]:
    """Every job once per port under test (--impl, repeatable: a sweep axis)."""
    if not impls:
        if port_stages:
            raise UsageError("--port-stages needs --impl")
        return jobs
    from harness.ports.registry import parse_impl
    labels = [parse_impl(i).label for i in impls]
    out = [replace(j, settings=replace(j.settings, impl=lab, port_stages=port_stages)) for lab in labels for j in jobs]
    return [replace(j, index=i) for i, j in enumerate(out)]


def on_device(jobs: list[SettingJob], device: str) -> list[SettingJob]:
    """Every job's settings moved to `device` (case files do not name one)."""
    return [replace(j, settings=replace(j.settings, device=device)) for j in jobs]


def verdict(job: SettingJob, r: SettingResult) -> str:
    """The table's verdict: error | pass | DIVERGE, or for an expected fault
    caught (diverged and named as its catalog entry says) | MISSED."""
    if r.usage_error:
        return "error"
    if r.summary.get("verdict") in ("internal-error", "oracle-crash", "port-error"):
        return r.summary["verdict"]   # ddcheck could not judge this setting, or the port raised in its own code
    if r.summary.get("skipped"):
        return "skip"
    if job.expect_fault:
        return "caught" if expected_fault_caught(r.summary) else "MISSED"
    return "pass" if r.passed else "DIVERGE"


def unjudged_lines(results: list["SettingResult"]) -> list[str]:
    """One line per setting ddcheck could not judge (its own crash or the
    oracle's): a sweep or gate with any exits 3."""
    out = []
    for r in results:
        crash = r.summary.get("crash") or {}
        if r.summary.get("verdict") in ("internal-error", "oracle-crash"):
            who = "internal error (a bug in ddcheck)" if crash.get("side") == "ddcheck" else "the oracle raised"
            out.append(f"ddcheck: {who}: {crash.get('error')} at {crash.get('where')} (setting: {r.setting})")
    return out


def port_error_lines(results: list["SettingResult"]) -> list[str]:
    """One line per setting whose port raised in its own code before anything
    diverged: a sweep or gate with any (and none unjudged) exits 4."""
    out = []
    for r in results:
        crash = r.summary.get("crash") or {}
        if r.summary.get("verdict") == "port-error":
            out.append(f"ddcheck: the port under test raised {crash.get('error')} at {crash.get('where')} in its own "
                       f"code, under SGLang {crash.get('sglang')} (setting: {r.setting})")
    return out


def exit_code(results: list["SettingResult"], failed: bool) -> int:
    """3 when a setting could not be judged (ddcheck's or the oracle's raise), else 4 when
    a port raised in its own code, else 1 on any failure, else 0."""
    return 3 if unjudged_lines(results) else 4 if port_error_lines(results) else 1 if failed else 0


@dataclass(frozen=True)
class SettingResult:
    index: int
    setting: str            # the reproduce command
    summary: dict           # the summary record
    localize: dict | None   # the localize record, when the check wrote one
    lines: tuple[str, ...]  # every JSONL line of the setting
    wall_s: float
    usage_error: str | None = None

    @property
    def passed(self) -> bool:
        return self.usage_error is None and bool(self.summary.get("passed"))


def run_job(job: SettingJob, loads=None) -> SettingResult:
    """One setting, in this process. Usage errors come back as data; an
    exception inside the engine is a failing setting (a crash is a finding).
    loads: a harness.check.prepare.LoadCache the caller's settings share (one
    reading of a checkpoint for consecutive settings of the same model)."""
    from harness.check.differential import check, write_crash_summary, write_load_divergence
    from harness.check.load_agreement import LoadDivergence
    from harness.check.summary import CheckSummary, summary_record
    from harness.check.prepare import LoadCache
    from harness.check.prepare import USAGE_ERRORS
    from harness.ports.attach import SettingSkipped
    t0 = time.perf_counter()
    s = job.settings
    writer = RecordWriter(None)
    try:
        prepared = (loads or LoadCache()).prepare(s, job.prompts)
    except (SettingSkipped, NotRunnableHere) as e:   # the port or this machine cannot run it: a summary saying why
        writer.begin_run()
        writer.write({**summary_record(s, CheckSummary(setting=s.command())), "skipped": str(e)})
        return SettingResult(job.index, s.command(), json.loads(writer.lines[-1]), None, tuple(writer.lines),
                             time.perf_counter() - t0)
    except LoadDivergence as e:   # the engine's loader raised on a checkpoint the oracle read: a divergence
        prepared = None
        write_load_divergence(s, writer, e.mismatches)
    except USAGE_ERRORS as e:
        return SettingResult(job.index, s.command(), {}, None, (), time.perf_counter() - t0, str(e))
    except Exception as e:  # noqa: BLE001  (building the engine or loading the oracle raised: attributed)
        prepared = None
        write_crash_summary(s, writer, e)
        if reproduced_by_its_command(job):   # no engine to rerun in-process: its command again, a stage replaced
            from harness.workflows.reruns import prove_written_summary, run_argv
            prove_written_summary(writer, e, run_argv(s.command()))
    if prepared is not None:
        try:
            check(prepared, writer)
        except Exception as e:  # noqa: BLE001  (check() keeps its crashes; one that escaped it, attributed)
            write_crash_summary(s, writer, e)
    if job.expect_fault or job.acceptance is not None:  # the summary is the last line: the gate's expectation
        last_line = json.loads(writer.lines.pop())     # goes into it, so every rendering reads the same verdict
        assert last_line["kind"] == "summary", "check() writes the summary last"
        writer.write({**last_line, **gate_expectation(job, last_line)})
    records = [json.loads(ln) for ln in writer.lines]
    summary = next((r for r in reversed(records) if r["kind"] == "summary"), {})
    localize = next((r for r in records if r["kind"] == "localize"), None)
    return SettingResult(job.index, s.command(), summary, localize, tuple(writer.lines), time.perf_counter() - t0)


def reproduced_by_its_command(job: SettingJob) -> bool:
    """Whether `ddcheck run` with the setting's command line runs what the job ran: the same prompts."""
    from harness.check.prompts import prompts_of
    try:
        return job.prompts is None or job.prompts == prompts_of(job.settings)
    except ValueError:   # a case's prompts: the command names the case, not what the job was handed
        return False


def worker_died(job: SettingJob, reasons: tuple[str, ...]) -> SettingResult:
    """A setting whose worker died every time it ran (killed, out of memory,
    its node lost): a crash summary, so ddcheck could not judge it (exit 3)."""
    from harness.check.differential import write_crash_summary
    writer = RecordWriter(None)
    write_crash_summary(job.settings, writer, RuntimeError(
        f"the worker running this setting died {len(reasons)} times: {'; '.join(reasons)}"))
    summary = json.loads(writer.lines[-1])
    return SettingResult(job.index, job.settings.command(), summary, None, tuple(writer.lines), 0.0)


def gate_expectation(job: SettingJob, summary: dict) -> dict:
    """The gate's expectation of a setting, for its summary record: the fault
    it must catch (expect_fault, expect_class), or the acceptance baseline a
    passing run must hold (acceptance_floor, acceptance_shortfall: why it did
    not, null when it did)."""
    if job.expect_fault:
        from harness.faults.registry import catalog
        return {"expect_fault": job.expect_fault, "expect_class": catalog()[job.expect_fault].expected_class}
    if not summary.get("passed"):
        return {}
    return {"acceptance_floor": job.acceptance.floor,
            "acceptance_shortfall": job.acceptance.shortfall(summary.get("mean_accepted_length"))}


class Interrupted(Exception):
    """Ctrl-C during a sweep: the settings that finished, in job order."""

    def __init__(self, finished: list[SettingResult], total: int) -> None:
        super().__init__(f"interrupted after {len(finished)} of {total} settings")
        self.finished, self.total = finished, total


def prepare_environment() -> None:
    """TRITON_INTERPRET must be in the environment before any process imports
    triton; spawned workers inherit it."""
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def validate(jobs: list[SettingJob]) -> None:
    """Fail fast, before any setting runs (raises the usage errors of
    harness.check.prepare.USAGE_ERRORS): every backend builds here, every model is known and
    every checkpoint readable (config and safetensors headers), every prompt
    token and --eos-id within the vocabulary, every port imports (in a child
    process, harness.ports.import_check)."""
    from harness.engine.attn import make_backend
    from harness.workflows.cases import model_vocab
    from harness.engine.model.presets import PRESETS, check_checkpoint, model_dir
    from harness.ports.attach import check_port_stages
    from harness.ports.import_check import check_port_imports
    prepare_environment()
    for backend, device, dtype in {(j.settings.backend, j.settings.device, j.settings.dtype) for j in jobs}:
        make_backend(backend, device, RunSettings(dtype=dtype).torch_dtype)
    vocab = {}
    for model in dict.fromkeys(j.settings.model for j in jobs):
        vocab[model] = model_vocab(model) if model in PRESETS else check_checkpoint(model_dir(model)).vocab_size
    for j in jobs:
        check_vocabulary(j, vocab[j.settings.model])
    check_port_imports(j.settings.impl for j in jobs)
    for impl, port_stages in dict.fromkeys((j.settings.impl, j.settings.port_stages) for j in jobs if j.settings.impl):
        check_port_stages(impl, port_stages)


def check_vocabulary(job: SettingJob, vocab: int) -> None:
    """The token ids a setting brings (its prompts, --eos-id) exist in the model."""
    for spec in job.prompts or ():   # None: the model's own text prompts, from its tokenizer
        if spec.tokens and max(spec.tokens) >= vocab:
            raise UsageError(f"prompt {spec.name!r}: token id {max(spec.tokens)} is outside the model's vocabulary "
                             f"(vocab_size {vocab}) (setting: {job.settings.command()})")
    if job.settings.eos_id is not None and job.settings.eos_id >= vocab:
        raise UsageError(f"--eos-id {job.settings.eos_id} is outside the model's vocabulary (vocab_size {vocab})")


def job_inputs(jobs: list[SettingJob], *case_files: Path | None) -> list[tuple[str, Path]]:
    """What the settings read, as (flag, path): checkpoints, case and prompt
    files, port files, and the case files named on the command line."""
    from harness.engine.model.presets import model_input
    found = [("case file", Path(p)) for p in case_files if p is not None]
    for j in jobs:
        s = j.settings
        for what, p in (("--model", model_input(s.model)), ("--case", s.case),
                        ("--prompt-file", s.prompt_file), ("--impl", (s.impl or "").partition(":")[2] or None)):
            if p is not None:
                found.append((what, Path(p)))
    return list(dict.fromkeys(found))


def default_jobs() -> int:
    return os.cpu_count() or 1


def run_jobs(jobs: list[SettingJob], n_jobs: int,
             on_done: Callable[[SettingJob, SettingResult], None] | None = None,
             executor: ExecutorSpec | None = None) -> list[SettingResult]:
    """Run every job on `executor` (default: the local process pool of n_jobs
    workers, this process for one); results in job order."""
    spec = executor or ExecutorSpec("local", max(1, n_jobs))
    runner = make_executor(spec)   # before anything runs: a missing optional package is a usage error
    prepare_environment()
    by_index = {j.index: j for j in jobs}
    results: dict[int, SettingResult] = {}

    def done(r: SettingResult) -> None:
        results[r.index] = r
        if on_done:
            on_done(by_index[r.index], r)

    read_once = [j for j in jobs if reads_checkpoint(j)]
    ordered = sorted((j for j in jobs if not reads_checkpoint(j)), key=lambda j: -j.cost)
    try:
        if ordered:
            runner.run(ordered, done, run_job, worker_died, _died)
        run_reading_once(read_once, done)
    except KeyboardInterrupt:
        raise Interrupted([results[j.index] for j in jobs if j.index in results], len(jobs)) from None
    return [results[j.index] for j in jobs]


def reads_checkpoint(job: SettingJob) -> bool:
    """A checkpoint directory, not a preset: reading it costs seconds to
    minutes and, on a GPU, its memory; its settings share one reading."""
    from harness.engine.model.presets import PRESETS
    return job.settings.model not in PRESETS


def run_reading_once(jobs: list[SettingJob], done) -> None:
    """Settings of checkpoint directories, in this process, grouped by what
    the reading depends on (harness.check.prepare.load_key): each checkpoint is
    read once and held alone; a worker per setting would read it once each,
    and on one GPU hold it once each."""
    from harness.check.prepare import LoadCache, load_key
    loads = LoadCache()
    for job in sorted(jobs, key=lambda j: (repr(load_key(j.settings)), -j.cost)):
        done(run_job(job, loads))
    loads.loaded = None


def _died(index: int, setting: str, summary: dict, lines: tuple[str, ...], wall_s: float) -> SettingResult:
    """The result of a setting whose process died once, from the crash its fault dump names (worker_deaths.py)."""
    return SettingResult(index, setting, summary, None, lines, wall_s)


def write_jsonl(results: list[SettingResult], path: Path, interrupted: tuple[int, int] | None = None) -> None:
    """One JSONL for the whole sweep, settings in order (each line carries `setting`);
    after a Ctrl-C, a last `interrupted` record (finished, total)."""
    writer = RecordWriter(path)
    for r in results:
        writer.lines.extend(r.lines)
    if interrupted:
        writer.write({"kind": "interrupted", "finished": interrupted[0], "total": interrupted[1]})
    writer.commit()


def summary_frame(jobs: list[SettingJob], results: list[SettingResult]):
    """One row per setting: axes, nodes checked, divergent nodes, first divergence."""
    import pandas as pd
    from harness.report.model import describe_first
    rows = []
    for j, r in zip(jobs, results):
        s, m = j.settings, r.summary
        rows.append({"#": j.index, "case": j.case, "budget": s.budget, "topk": s.topk,
                     "graph": "on" if s.cuda_graph else "off", "backend": s.backend, "batch": s.batch,
                     "dtype": s.dtype, "fault": s.fault or "", "nodes": m.get("nodes_checked", 0),
                     "divergent": m.get("divergent_nodes", 0), "near_ties": m.get("near_ties", 0),
                     "max_rel_err": m.get("max_rel_err", float("nan")),
                     "accepted": m.get("mean_accepted_length"),
                     "first_divergence": r.usage_error or describe_first(m),
                     "verdict": verdict(j, r),
                     "seconds": round(r.wall_s, 1)})
    return pd.DataFrame(rows)
