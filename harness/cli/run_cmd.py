"""`ddcheck run`: one setting, compared per node, summarised.

Layer: cli. Imports any layer below it."""
from __future__ import annotations

from pathlib import Path
from typing import List, NoReturn, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from harness.check.differential import check
from harness.check.stop import STOP_EXITS, RunStopped, stoppable

from harness.check.summary import CheckSummary

from harness.check.load_agreement import LoadDivergence
from harness.check.prepare import prepare
from harness.ports.attach import SettingSkipped
from harness.cli.app import app
from harness.cli.summary_table import print_summary
from harness.cli.common import USAGE_ERRORS, check_outputs, fail_usage, pick_backend, pick_device, take_or_fail
from harness.check.outputs import OutputClaim, check_not_inputs
from harness.check.records import RecordWriter
from harness.workflows.calibrate import parse_noise_rule
from harness.check.prompts import parse_prompt_lens
from harness.workflows.cases import prompts_for
from harness.engine.settings import RunSettings, UsageError


SIDE_BY_SIDE_OUT = Path("reports") / "side-by-side.jsonl"


def default_out(s: RunSettings) -> Path:
    graph = "graph" if s.cuda_graph else "eager"
    fault = f"-{s.fault}" if s.fault else ""
    page = f"-p{s.page_size}" if s.page_size != 1 else ""
    tp = f"-tp{s.tp}" if s.tp != 1 else ""
    name = f"run-b{s.budget}-k{s.topk}-{graph}-bs{s.batch}-{s.backend}-{s.dtype}{page}{tp}{fault}.jsonl"
    return Path("reports") / name


@app.command()
def run(
    budget: int = typer.Option(16, help="DDTree budget B (verify width q_len = B + 1)"),
    topk: int = typer.Option(1, help="candidates per depth K"),
    cuda_graph: bool = typer.Option(False, "--cuda-graph/--no-cuda-graph", help="verify through the graph runner"),
    backend: Optional[str] = typer.Option(None, help="attention backend: sglang-triton (default when SGLang imports) or torch"),
    batch: int = typer.Option(1, help="requests per verify batch"),
    max_new_tokens: int = typer.Option(24, help="tokens each request generates"),
    block_size: int = typer.Option(8, help="drafter block size (depth cap L = block_size - 1)"),
    model: str = typer.Option("tiny", help="preset (tiny, small, tiny-qwen2, tiny-qwen3, tiny-sinks, tiny-softcap, ...), a trained model (smollm2-135m: `ddcheck models`) or a local HF checkpoint directory"),
    seed: int = typer.Option(0),
    dtype: str = typer.Option("float32", help="float32, float16 or bfloat16"),
    fault: Optional[str] = typer.Option(None, help="switch on a named fault (`ddcheck faults`)"),
    accept: str = typer.Option("walk", help="acceptance stage: walk or sglang"),
    device: str = typer.Option("auto", help="auto, cpu or cuda"),
    tolerance: Optional[float] = typer.Option(None, help="relative logit tolerance (default: the dtype's, see docs)"),
    out: Optional[Path] = typer.Option(None, help="JSONL records (default reports/run-<setting>.jsonl)"),
    html: Optional[Path] = typer.Option(None, help="also write a self-contained HTML report"),
    impl: Optional[List[str]] = typer.Option(None, help="a DDTree port under test, FAMILY:PATH (`ddcheck ports`); "
                                             "twice or more: side by side on the same drafts"),
    port_stages: Optional[str] = typer.Option(None, help="which of the port's stages to use: build,compile,accept,commit "
                                              "(default: all it provides; ddcheck's own for the rest)"),
    strict: bool = typer.Option(False, help="audit warnings (findings that change no logits here) fail the run"),
    kv_poison: bool = typer.Option(True, "--kv-poison/--no-kv-poison",
                                   help="free KV slots hold NaN, so a read of one shows even under a zero weight"),
    eos_id: Optional[int] = typer.Option(None, help="end-of-sequence token id: streams stop there, on both sides"),
    stop_after: int = typer.Option(2, help="end the run after this many divergent verify steps (0: run to the end)"),
    case: Optional[Path] = typer.Option(None, help="take the prompts of this case file (the reproduce commands of "
                                        "a gate or a sweep --case name it)"),
    prompt_len: Optional[str] = typer.Option(None, help="prompts of these lengths, drawn from the seed: 600 or 520,900"),
    prompt_file: Optional[Path] = typer.Option(None, help="prompts as JSON token ids ([..] or [[..], [..]]), or a text "
                                               "file tokenized by the checkpoint's tokenizer.json"),
    verdict: str = typer.Option("auto", help="how nodes are judged: fixed (the dtype's tolerance), noise-floor (each "
                                "node against its correct low-precision twin), auto (noise-floor for bf16/fp16)"),
    noise_rule: Optional[str] = typer.Option(None, help="a calibrated noise floor MULTIPLIER,FLOOR,CEILING for a bf16/fp16 "
                                             "run (`ddcheck calibrate` measures one)"),
    tf32: bool = typer.Option(False, help="float32 on CUDA: let Triton's dots run in TF32 (default: IEEE float32, "
                              "judged at the float32 tolerance; with --tf32 at the labelled tf32 one)"),
    sliding_window: Optional[int] = typer.Option(None, help="a sliding window of N keys (the query's own included) on "
                                                 "the model's sliding layers, else on every layer; both sides read "
                                                 "it from the checkpoint's config.json"),
    oracle_device: str = typer.Option("auto", help="where the float64 oracle computes: auto (the run's GPU when its "
                                      "float64 weights fit, else the CPU), cpu, cuda or cuda:N"),
    oracle: str = typer.Option("auto", help="which float64 oracle judges: dense (the whole model held), streamed (one "
                               "layer at a time, read from the checkpoint), auto (dense where it fits, else streamed)"),
    page_size: int = typer.Option(1, help="KV page size: 1, or a power of two up to 64 (branch regions of whole "
                                  "pages, compaction at commit)"),
    drafter: str = typer.Option("auto", help="noisy (a seeded stand-in), self (the target's first --draft-layers "
                                "layers + norm + head, an early exit), auto (self for a checkpoint, noisy for a preset)"),
    draft_layers: Optional[int] = typer.Option(None, help="the self-draft's layer count k (default: all but the target's last two layers)"),
    tp: int = typer.Option(1, help="tensor-parallel ranks of the engine under test, launched by ddcheck (gloo on the "
                           "CPU, NCCL on GPUs); DDCHECK_TP_TIMEOUT_S bounds a silent rank"),
    timeout: Optional[float] = typer.Option(None, help="stop the run after SECONDS (as SIGTERM or Ctrl-C do): the "
                                            "records so far and a summary of verdict `stopped`, exit 124"),
) -> None:
    """Run the engine next to the oracle for one setting; exit 0 match, 1 divergence, 2 usage."""
    try:
        check_outputs(out=out, html=html)
        if timeout is not None and not 0 < timeout <= MAX_TIMEOUT_S:
            raise UsageError(f"--timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {timeout:g}")
        s = RunSettings(budget=budget, topk=topk, cuda_graph=cuda_graph, backend=pick_backend(backend),
                        batch=batch, max_new_tokens=max_new_tokens, block_size=block_size, model=model,
                        seed=seed, dtype=dtype, fault=fault, accept=accept, device=pick_device(device),
                        tolerance=tolerance, impl=impl[0] if impl else None, port_stages=port_stages, strict=strict,
                        kv_poison=kv_poison, eos_id=eos_id, stop_after=stop_after, case=str(case) if case else None,
                        prompt_lens=parse_prompt_lens(prompt_len), prompt_file=str(prompt_file) if prompt_file else None,
                        oracle_device=oracle_device, oracle=oracle, verdict=verdict, tf32=tf32,
                        noise_rule=parse_noise_rule(noise_rule), sliding_window=sliding_window,
                        page_size=page_size, drafter=drafter, draft_layers=draft_layers, tp=tp)
        path = out or (SIDE_BY_SIDE_OUT if impl and len(impl) > 1 else default_out(s))
        check_outputs(out=path)   # the default path too: never a link, a device or a FIFO
        check_not_inputs({"--out": path, "--html": html}, run_inputs(s, impl).items())
        if impl:
            from harness.ports.import_check import check_port_imports
            check_port_imports(impl)   # in a child process: an exit at import is a failure, never a pass
    except USAGE_ERRORS as e:
        fail_usage(e)
    with OutputClaim("run", 1, out=path, html=html) as claim, stoppable(timeout):
        run_claimed(s, impl, claim, path, html)


def run_inputs(s: RunSettings, impl: list[str] | None) -> dict:
    """What a run reads (flag -> path): never one of its outputs."""
    from harness.engine.model.presets import model_input
    inputs = {"--model": model_input(s.model), "--case": s.case, "--prompt-file": s.prompt_file}
    for i, label in enumerate(impl or ()):
        inputs[f"--impl #{i + 1}"] = label.partition(":")[2] or None
    return inputs


def run_claimed(s: RunSettings, impl: list[str] | None, claim: OutputClaim, path: Path, html: Path | None) -> NoReturn:
    """The run once its outputs are checked: the model inputs (a usage error
    still leaves the outputs as they were), then the outputs taken over, the
    check, the records."""
    try:
        if impl and len(impl) > 1:
            from harness.cli.side_by_side import run_side_by_side
            run_side_by_side(s, impl, path, html, claim)
        prepared = prepare(s, prompts_for(s))
    except RunStopped as e:   # stopped while loading: no step ran
        take_or_fail(claim)
        stopped(s, RecordWriter(path), e)
    except SettingSkipped as e:
        take_or_fail(claim)
        skipped(s, path, e)
    except LoadDivergence as e:   # the engine's loader raised on a checkpoint the oracle read: a divergence
        take_or_fail(claim)
        load_diverged(s, RecordWriter(path), e)
    except USAGE_ERRORS as e:
        fail_usage(e)
    except typer.Exit:   # a side-by-side run ends the command itself
        raise
    except Exception as e:  # noqa: BLE001  (building the engine or loading the oracle raised: attributed)
        take_or_fail(claim)
        crashed(s, RecordWriter(path), e)
    take_or_fail(claim)
    writer = RecordWriter(path)
    console = Console(stderr=True)
    with Progress(TextColumn("[bold]verify"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("verify", total=s.max_new_tokens * s.batch)
        try:
            summary = check(prepared, writer, lambda step, done: bar.update(task, completed=done))
        except RunStopped as e:   # check() keeps its own stops; this one came while its summary was written
            stopped(s, writer, e)
        except Exception as e:  # noqa: BLE001  (check() keeps its own crashes; this one escaped it)
            crashed(s, writer, e)
    writer.commit()
    print_summary(Console(), summary, path)
    if html:
        from harness.report.html import write_report
        write_report([path], html)
    if summary.crash:
        typer.echo(crash_line(summary.crash, summary, path), err=True)
    if summary.stopped:
        typer.echo(f"ddcheck: {summary.notes[-1]} (records: {path})", err=True)
    raise typer.Exit(exit_code(summary))


def skipped(s: RunSettings, path: Path, e: Exception) -> NoReturn:
    """A setting the port cannot run: a summary saying why, exit 0 (not a pass, not a failure)."""
    from harness.check.summary import CheckSummary, summary_record
    writer = RecordWriter(path)
    writer.begin_run()
    writer.write({**summary_record(s, CheckSummary(setting=s.command())), "skipped": str(e)})
    writer.commit()
    typer.echo(f"SKIP: {e} (records: {path})")
    raise typer.Exit(0)


# exit codes by the summary's verdict: 3 when ddcheck could not judge (its own bug, or the oracle's),
# 4 when the port under test raised in its own code before anything diverged
EXIT_CODES = {"pass": 0, "diverge": 1, "oracle-crash": 3, "internal-error": 3, "port-error": 4}
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def exit_code(summary: CheckSummary) -> int:
    """By the verdict; a stopped run by its reason (124 timeout, 130 SIGINT, 143 SIGTERM: check/stop.py)."""
    if summary.verdict == "stopped":
        return STOP_EXITS[summary.stopped]
    return EXIT_CODES[summary.verdict]


def stopped(s: RunSettings, writer: RecordWriter, stop: RunStopped) -> NoReturn:
    """A stop check() did not keep: the records so far and a summary of verdict `stopped`."""
    from harness.check.differential import write_stopped_summary
    summary = write_stopped_summary(s, writer, stop)
    writer.commit()
    typer.echo(f"ddcheck: {summary.notes[-1]} (records: {writer.path})", err=True)
    raise typer.Exit(exit_code(summary))


def crash_line(crash: dict, summary: CheckSummary, path: Path) -> str:
    """One stderr line, distinct per side."""
    seen = summary.divergent_nodes + summary.nonfinite_padding_rows + summary.stream_mismatches
    before = f"; {seen} divergences recorded before it" if seen else ""
    if crash["side"] == "ddcheck":
        return (f"ddcheck: internal error (a bug in ddcheck, not a verdict on the engine): {crash['error']} at "
                f"{crash['where']}{before} (records: {path})")
    if crash["side"] == "oracle":
        return f"ddcheck: the oracle raised {crash['error']} at {crash['where']}{before} (records: {path})"
    if crash["side"] == "port":
        verdict = "" if before else ": not a divergence, not a pass"
        return (f"ddcheck: the port under test raised {crash['error']} at {crash['where']} in its own code, under "
                f"SGLang {crash.get('sglang')}{before}{verdict} (records: {path})")
    return f"ddcheck: the engine under test raised {crash['error']} at {crash['where']}{before} (records: {path})"


def load_diverged(s: RunSettings, writer: RecordWriter, e: LoadDivergence) -> NoReturn:
    """The engine's loader raised on a checkpoint the oracle read: the load records, a failing summary, exit 1."""
    from harness.check.differential import write_load_divergence
    summary = write_load_divergence(s, writer, e.mismatches)
    writer.commit()
    print_summary(Console(), summary, writer.path)
    raise typer.Exit(exit_code(summary))


def crashed(s: RunSettings, writer: RecordWriter, e: Exception) -> NoReturn:
    """An exception check() did not keep: the records so far, a crash record
    naming the side, a failing summary; exit by its verdict."""
    from harness.check.differential import write_crash_summary
    summary = write_crash_summary(s, writer, e)
    # before any verify step, no engine to rerun in-process: the same run again in new processes, a stage replaced
    from harness.workflows.reruns import prove_written_summary
    prove_written_summary(writer, e)
    writer.commit()
    typer.echo(crash_line(summary.crash, summary, writer.path), err=True)
    raise typer.Exit(EXIT_CODES[summary.verdict])
