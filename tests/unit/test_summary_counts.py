"""Summaries count consistently: divergent nodes are judged nodes (never more
than the nodes checked); padding rows whose logits are not finite are a
divergence counted on their own, in every view (the summary record, the
terminal table, the HTML report)."""
import pytest

from harness.check.differential import check
from harness.check.prepare import prepare
from harness.check.records import RecordWriter
from harness.check.summary import CheckSummary, summary_record
from harness.engine.settings import RunSettings


def test_nan_padding_rows_do_not_inflate_divergent_nodes():
    """Fully masked padding rows (NaN on the torch backend) poison every real row of
    the next layer: every judged node diverges, and the padding rows are counted apart."""
    s = RunSettings(budget=16, topk=1, backend="torch", max_new_tokens=3, fault="padded-row-fully-masked")
    summary = check(prepare(s), RecordWriter(None), localize=False)
    assert not summary.passed and summary.nonfinite_padding_rows > 0
    assert 0 < summary.divergent_nodes <= summary.nodes_checked
    assert summary.nonfinite_padding_rows <= summary.padding_rows
    record = summary_record(s, summary)
    assert record["divergent_nodes"] <= record["nodes_checked"]


def test_a_summary_claiming_more_divergent_than_checked_is_refused():
    s = RunSettings(budget=4, backend="torch")
    with pytest.raises(ValueError, match="64 divergent nodes of 46 checked"):
        summary_record(s, CheckSummary(setting="x", nodes_checked=46, divergent_nodes=64))


def test_nonfinite_padding_rows_alone_fail_the_run():
    assert not CheckSummary(setting="x", nodes_checked=3, nonfinite_padding_rows=1).checks_passed


@pytest.mark.parametrize("fields, named", [
    (dict(stream_mismatches=1), "stream mismatches 1"),
    (dict(tree_mismatches=2), "tree mismatches 2"),
    (dict(accept_ref_mismatches=1), "accept-ref mismatches 1"),
    (dict(accept_mismatches=3), "accept mismatches 3"),
    (dict(nonfinite_padding_rows=1), "non-finite padding rows 1"),
    (dict(drift_exceeded=True, noise_drift=1.8), "noise drift 1.80"),
    (dict(excess_exceeded=True, noise_excess=dict(above=40, nodes=400, p=1e-30)), "noise excess 40 of 400"),
    (dict(audit_warnings=1, strict=True), "audit warnings (strict) 1"),
])
def test_a_diverge_with_no_divergent_node_names_its_check(fields, named):
    """A verdict of diverge always says why: the record's failed_checks names the run-level check."""
    s = CheckSummary(setting="x", nodes_checked=10, **fields)
    record = summary_record(RunSettings(budget=4, backend="torch"), s)
    assert record["verdict"] == "diverge" and record["divergent_nodes"] == 0
    assert any(c.startswith(named) for c in record["failed_checks"]), record["failed_checks"]


def test_a_pass_names_no_failed_check():
    s = CheckSummary(setting="x", nodes_checked=10, audit_warnings=1)   # warnings fail only under --strict
    assert summary_record(RunSettings(budget=4, backend="torch"), s)["failed_checks"] == [] and s.passed


def test_the_terminal_table_names_the_failed_check_when_no_node_diverged(tmp_path):
    from rich.console import Console
    from harness.cli.summary_table import print_summary
    console = Console(record=True, width=200)
    print_summary(console, CheckSummary(setting="x", nodes_checked=10, tree_mismatches=1, tolerance=1e-2), tmp_path / "r.jsonl")
    text = console.export_text()
    assert "failed checks" in text and "tree mismatches 1" in text and "DIVERGE" in text
