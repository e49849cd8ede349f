"""`ddcheck run --impl A --impl B`: several implementations on the same
drafts (the drafter is seeded per request and step), each checked against
the oracle, then compared with each other node by node.

Layer: cli. Imports any layer below it."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

import typer

from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings


def _node_key(rec: dict) -> tuple:
    return rec["step"], rec["request"], rec["node"]


def first_difference(a: list[dict], b: list[dict]) -> str | None:
    """Where two implementations' node records first differ (tree, acceptance or verdict)."""
    na = {_node_key(r): r for r in a if r["kind"] == "node"}
    nb = {_node_key(r): r for r in b if r["kind"] == "node"}
    for key in sorted(set(na) | set(nb)):
        ra, rb = na.get(key), nb.get(key)
        if ra is None or rb is None:
            return f"step {key[0]}, request {key[1]}: row {key[2]} exists in only one tree"
        for field in ("token", "parent", "is_padding", "accepted", "verdict"):
            if ra[field] != rb[field]:
                return (f"step {key[0]}, request {key[1]}, row {key[2]}: {field} {ra[field]!r} against "
                        f"{rb[field]!r}")
    return None


def run_side_by_side(base: RunSettings, impls: list[str], path: Path, html: Path | None, claim) -> NoReturn:
    """Every port loads before anything runs (a usage error leaves the outputs as they were);
    `claim` (harness.check.outputs.OutputClaim) then takes the outputs over."""
    from harness.check.differential import check
    from harness.check.prepare import LoadCache
    from harness.cli.summary_table import print_summary
    from harness.workflows.cases import prompts_for
    from harness.ports.attach import SettingSkipped
    from rich.console import Console
    prepared, loads = [], LoadCache()   # one reading of the checkpoint under every port
    for impl in impls:   # every port loads (and its settings validate) before anything runs
        s = replace(base, impl=impl)
        try:
            prepared.append((impl, loads.prepare(s, prompts_for(s))))
        except SettingSkipped as e:
            typer.echo(f"SKIP {impl}: {e}")
    from harness.cli.common import take_or_fail
    take_or_fail(claim)
    writer = RecordWriter(path)
    per_impl, failed = {}, False
    for impl, p in prepared:
        start = len(writer.lines)
        summary = check(p, writer)
        per_impl[impl] = [json.loads(ln) for ln in writer.lines[start:]]
        failed |= not summary.passed
        print_summary(Console(), summary, path)
    names = list(per_impl)
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            diff = first_difference(per_impl[names[i]], per_impl[names[j]])
            line = f"{names[i]} vs {names[j]}: " + (f"first differ at {diff}" if diff else "identical trees, "
                                                   "acceptance and verdicts")
            writer.write({"kind": "side-by-side", "a": names[i], "b": names[j], "first_difference": diff})
            typer.echo(line)
    writer.commit()
    if html:
        from harness.report.html import write_report
        write_report([path], html)
    raise typer.Exit(1 if failed else 0)
