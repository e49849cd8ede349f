"""The engine's round counter is checked: each verify round carries the count of rounds before it (the records,
the localizer's reruns to a step and --stop-after read it). A counter that stops (`step += 0`, a mutant that
survived every other check: outputs right, labels wrong) is the engine's divergence."""
from __future__ import annotations

from dataclasses import replace

from harness.check.differential import check
from harness.check.prepare import prepare
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings


def _relabelled(engine, label):
    rounds = engine.rounds

    def relabelled():
        for i, result in enumerate(rounds()):
            yield replace(result, step=label(i))
    engine.rounds = relabelled


def _run(label=None):
    p = prepare(RunSettings(budget=8, topk=2, batch=1, max_new_tokens=8, backend="torch"))
    if label is not None:
        _relabelled(p.engine, label)
    return check(p, RecordWriter(None), localize=True)


def test_a_counter_that_stops_is_a_divergence_named_at_the_round_it_mislabels():
    summary = _run(lambda i: 0)
    assert summary.first is not None and summary.first.what == "round" and summary.first.step == 1, summary.first
    assert "as step 0" in summary.first.detail and summary.fault_class == "round" and summary.stage is None
    assert summary.verdict == "diverge" and summary.round_mismatches == summary.steps - 1
    assert summary.failed_checks == [f"round mismatches {summary.steps - 1}"]


def test_rounds_counted_from_zero_pass():
    summary = _run()
    assert summary.first is None and summary.steps > 1 and summary.verdict == "pass" and summary.round_mismatches == 0
