"""Acceptance as a measured quantity: mean accepted length and per-depth
acceptance in the summary, a case's baseline with a band, and the gate
failing a build that falls below it."""
from __future__ import annotations

import json
import textwrap

import pytest

from harness.workflows.cases import CaseError, load_case
from harness.check.differential import check
from harness.check.prepare import prepare
from harness.check.compare.acceptance_stats import AcceptanceBaseline, AcceptanceTally
from harness.workflows.gate import judge, plan
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings
from harness.engine.ddtree.accept import Acceptance
from harness.engine.ddtree.tree import DraftTree
from harness.workflows.sweep import run_job

#   0 -> 1 -> 2 -> 3 (a chain), 0 -> 4
TREE = DraftTree((9, 1, 2, 3, 4), (None, 0, 1, 2, 0), (0, 1, 2, 3, 1), q_len=6)


def test_tally_counts_accepted_length_and_depth_acceptance():
    tally = AcceptanceTally()
    tally.add(TREE, Acceptance((0, 1, 2, 3), 7))  # all the way: 4 tokens
    tally.add(TREE, Acceptance((0, 1), 7))        # stops at depth 1 though row 1 has a child
    tally.add(TREE, Acceptance((0,), 7))          # rejects at the root
    tally.add(TREE, Acceptance((0, 4), 7))        # row 4 is a leaf: depth 2 not offered
    assert tally.mean_length == (4 + 2 + 1 + 2) / 4
    assert tally.offered == [4, 2, 1] and tally.reached == [3, 1, 1]
    assert tally.by_depth == [0.75, 0.5, 1.0]


def test_summary_carries_the_measured_acceptance():
    writer = RecordWriter(None)
    summary = check(prepare(RunSettings(budget=8, topk=1, batch=2, max_new_tokens=12, backend="torch")), writer,
                    localize=False)
    nodes = [json.loads(line) for line in writer.lines if '"kind": "node"' in line]
    accepted = {}
    for r in nodes:
        accepted[(r["step"], r["request"])] = accepted.get((r["step"], r["request"]), 0) + r["accepted"]
    assert summary.mean_accepted_length == pytest.approx(sum(accepted.values()) / len(accepted))
    assert 1.0 < summary.mean_accepted_length <= 8 and 0 < len(summary.acceptance_by_depth) <= 7
    assert all(0.0 <= a <= 1.0 for a in summary.acceptance_by_depth)
    record = json.loads(writer.lines[-1])
    assert record["mean_accepted_length"] == summary.mean_accepted_length
    assert record["acceptance_by_depth"] == summary.acceptance_by_depth


def write_case(tmp_path, baseline: str) -> object:
    path = tmp_path / "accept.toml"
    path.write_text(textwrap.dedent(f"""
        model = "tiny"
        max_new_tokens = 10
        [[matrix]]
        label = "chain"
        budget = 8
        topk = 1
        {baseline}
    """))
    return load_case(path)


def test_a_case_holds_a_baseline_with_a_band(tmp_path):
    case = write_case(tmp_path, "acceptance = { mean_accepted_length = 3.5, band = 0.5 }")
    assert case.matrix[0].acceptance == AcceptanceBaseline(3.5, 0.5)
    jobs = plan([case])
    assert jobs[0].acceptance == AcceptanceBaseline(3.5, 0.5)


@pytest.mark.parametrize("bad", ["acceptance = { mean_accepted_length = 0.5, band = 0.1 }",
                                 "acceptance = { mean_accepted_length = 3.0 }",
                                 "acceptance = { mean_accepted_length = 3.0, band = -1 }",
                                 "acceptance = { mean = 3.0, band = 0.1 }"])
def test_a_bad_baseline_is_a_case_error(tmp_path, bad):
    with pytest.raises(CaseError, match="acceptance"):
        write_case(tmp_path, bad)


def test_the_gate_fails_a_build_below_its_baseline(tmp_path):
    """Measured once, then judged against a floor just under it (passes) and
    just over it (fails, naming the shortfall)."""
    job = plan([write_case(tmp_path, "")])[0]
    result = run_job(job)
    measured = result.summary["mean_accepted_length"]
    assert result.passed and measured > 1.0
    for baseline, passes in [(measured + 0.05, True), (measured + 0.2, False)]:
        case = write_case(tmp_path, f"acceptance = {{ mean_accepted_length = {baseline}, band = 0.1 }}")
        job = plan([case])[0]
        (verdict,) = judge([job], [run_job(job)])   # the run records its floor; the gate reads it there
        assert verdict.passed == passes
        if not passes:
            assert "fell below the baseline" in verdict.message


def test_the_report_and_the_sweep_table_show_the_measured_acceptance(tmp_path):
    from harness.report.html import write_report
    from harness.workflows.sweep import summary_frame
    job = plan([write_case(tmp_path, "")])[0]
    result = run_job(job)
    records = tmp_path / "run.jsonl"
    records.write_text("\n".join(result.lines) + "\n")
    write_report([records], tmp_path / "r.html")
    html = (tmp_path / "r.html").read_text()
    measured = result.summary["mean_accepted_length"]
    assert "mean accepted length" in html and f"{measured:.2f}" in html and "acceptance by depth" in html
    assert summary_frame([job], [result])["accepted"].tolist() == [measured]
