"""The run's summary as a table on the terminal: a rendering of the summary
record's fields, nothing recomputed.

Layer: cli. Imports any layer below it."""
from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harness.check.summary import CheckSummary
from harness.engine.tp.audit import RANK_CLASSES


def print_summary(console: Console, summary: CheckSummary, path: Path) -> None:
    t = Table(title=summary.setting, show_header=False)
    t.add_row("verify steps", str(summary.steps))
    t.add_row("nodes checked", str(summary.nodes_checked))
    t.add_row("divergent nodes", str(summary.divergent_nodes))
    t.add_row("near ties", str(summary.near_ties))
    if summary.router_ties:
        t.add_row("router ties", f"{summary.router_ties} (a MoE router flip inside the noise on both sides)")
    t.add_row("padding rows seen", str(summary.padding_rows))
    if summary.nonfinite_padding_rows:
        t.add_row("non-finite padding rows", f"[red]{summary.nonfinite_padding_rows}[/] (NaN or inf: a divergence)")
    if summary.verdict_rule == "noise-floor":
        r = summary.noise_rule
        twins = (f"twins {summary.max_twin_err:.2e} ({summary.twin_nodes} of {summary.nodes_checked} nodes "
                 "needed one)" if summary.twin_nodes else "no node needed its twin")
        t.add_row("max rel. error", f"{summary.max_rel_err:.2e}; {twins}")
        t.add_row("noise ratio", f"max {summary.max_noise_ratio or 0:.2f} (diverge above {r['multiplier']:g} x "
                                 f"max(twin, {r['floor']:.1e}), or above {r['ceiling']:g})")
        if summary.noise_excess:
            x = summary.noise_excess
            t.add_row("noise excess", f"{x['above']} of {x['nodes']} nodes above {r.get('excess_ratio') or 0:g} x "
                                      f"their noise (binomial p {x['p']:.1e})")
    else:
        t.add_row("max rel. error", f"{summary.max_rel_err:.2e} (tolerance {summary.tolerance:.0e})")
    t.add_row("stream mismatches", str(summary.stream_mismatches))
    if summary.prefix_len_max:
        tiles = f"; the kernel walks {summary.key_tiles} key tiles of the longest" if summary.key_tiles else ""
        t.add_row("prefix length", f"{summary.prefix_len_min} to {summary.prefix_len_max} tokens{tiles}")
    if summary.engine_s_per_step is not None:
        t.add_row("time per step", f"engine {summary.engine_s_per_step * 1e3:.1f} ms, "
                                   f"oracle {summary.oracle_s_per_step * 1e3:.1f} ms (float64 on {summary.oracle_device}"
                                   f"{', streamed by layer' if summary.oracle == 'streamed' else ''}"
                                   f"{_ratio(summary.oracle_time_ratio)}; after step 0)")
    if summary.engine_warmup_s is not None:
        t.add_row("warm-up (step 0)", f"engine {summary.engine_warmup_s:.2f} s, oracle {summary.oracle_warmup_s:.2f} s")
    if summary.load_s:
        phases = ", ".join(f"{name.replace('_', ' ')} {sec:.1f} s" for name, sec in summary.load_s.items())
        streams = f"; stream check {summary.streams_s:.1f} s" if summary.streams_s is not None else ""
        t.add_row("load time", f"{sum(summary.load_s.values()):.1f} s ({phases}){streams}")
    if summary.stopped_early:
        t.add_row("stopped early", f"after {summary.divergent_steps} divergent steps (--stop-after)")
    if summary.mean_accepted_length is not None:
        depths = " ".join(f"{a:.2f}" for a in summary.acceptance_by_depth)
        t.add_row("accepted length", f"{summary.mean_accepted_length:.2f} tokens per step (acceptance by depth: {depths})")
    for st in summary.streams:   # decoded text, engine beside oracle: a stream of "!!!!" shows as such
        t.add_row(f"request {st['request']} ({escape(st['prompt'])})", escape(
            f"prompt {st['prompt_text']!r}\nengine {st['engine_text']!r}\noracle {st['reference_text']!r}"
            f" [{st['verdict']}]"))
    f = summary.first
    if f is None:
        t.add_row("first divergence", "none")
    elif f.what == "accept":
        t.add_row("first divergence", f"step {f.step}, request {f.request}: the acceptance stages disagree")
    elif f.what in ("tree", "accept-ref", "crash", "proven-crash"):
        t.add_row("first divergence", f"{f.what}: {f.detail}")
    elif f.what == "provenance":
        t.add_row("first divergence", f"step {f.step}, request {f.request}, KV provenance: {f.detail}")
    elif f.what in RANK_CLASSES:
        t.add_row("first divergence", escape(f"step {f.step}, TP ranks disagree: {f.detail}"))
    elif f.what in ("config", "weights"):
        t.add_row("first divergence", f"the checkpoint's {f.what}: the engine's loader and the oracle's disagree")
    elif f.what == "stream":
        t.add_row("first divergence", f"request {f.request}: emitted stream differs at token {f.node}")
    else:
        err = "non-finite" if f.rel_err is None else f"{f.rel_err:.2e}"
        t.add_row("first divergence", f"step {f.step}, request {f.request}, node {f.node} (depth {f.depth}), "
                  f"rel. error {err}, padding rows {'present' if f.padding_present else 'absent'}")
    if summary.port:   # the audit's evidence on the port's own metadata comes before the localizer's reading
        pt = summary.port
        stubs = f"; server imports stubbed: {', '.join(pt['stubbed_imports'])}" if pt["stubbed_imports"] else ""
        if pt.get("not_driven"):   # functions the port's worker never calls are not judged
            stubs += f"; not driven, its worker never calls {', '.join(pt['not_driven'].values())}"
        t.add_row("port", escape(f"{pt['impl']}: the port's {', '.join(pt['port_stages'])}; ddcheck's "
                                 f"{', '.join(pt['ddcheck_stages']) or 'nothing else'}{stubs}"))
        if pt.get("lineage"):   # which of the checkout's worker functions ran, at which commit
            lin = pt["lineage"]
            at = f"at {lin['commit'][:12]}" if lin.get("commit") else "(commit unknown: not a git checkout)"
            t.add_row("port code run", escape(f"{', '.join(lin['files'])} {at}: {', '.join(lin['reached']) or 'nothing'}"))
        if pt.get("served_verify_input"):   # what SGLang's TritonAttnBackend received (a serving backend)
            t.add_row("SGLang received", escape(", ".join(pt["served_verify_input"])))
        t.add_row("audit", escape(f"{summary.audit_errors} errors, {summary.audit_warnings} warnings"
                                  + (f"; first: {summary.first_finding}" if summary.first_finding else "")))
    if summary.explanation:
        t.add_row("localized", f"[bold]{escape(str(summary.fault_class))}[/]: {escape(summary.explanation)}")
    for r in summary.replacements:   # the first divergent step with one stage's output replaced
        t.add_row("replaced", escape(r["sentence"]))
    for note in summary.notes:
        t.add_row("note", escape(note))
    if summary.crash:
        t.add_row("crash", escape(f"{summary.crash['side']}: {summary.crash['sentence']}"))
    if summary.failed_checks:   # which checks made the verdict, divergent nodes or not
        t.add_row("failed checks", escape("; ".join(summary.failed_checks)))
    t.add_row("verdict", {"pass": "[green]PASS[/]", "diverge": "[red]DIVERGE[/]", "oracle-crash": "[red]ORACLE CRASH[/]",
                          "port-error": "[red]PORT ERROR[/] (the port raised in its own code)",
                          "internal-error": "[red]INTERNAL ERROR[/] (ddcheck)",
                          "stopped": f"[yellow]STOPPED[/] ({summary.stopped}; not a pass)"}[summary.verdict])
    console.print(t)
    typer.echo(f"records: {path}")   # outside the table: a path is never folded or cut


def _ratio(r: float | None) -> str:
    return f"; oracle/engine {r:.2f}x" if r is not None else ""
