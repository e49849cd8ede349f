"""The localizer judges what a round's verify read against req_to_token as it was when the kernel read it, not
after the round's commit: at page size > 1 the commit moves a prefix's tail page into the winning branch's
region, so afterwards req_to_token names other slots for those positions (an acceptance bug at page size 16
was explained as wrong kv_indices of the verify inputs)."""
from __future__ import annotations

from dataclasses import replace

from harness.check.differential import check
from harness.check.prepare import derive, prepare
from harness.check.records import RecordWriter
from harness.engine.ddtree.accept import Acceptance, greedy_walk
from harness.engine.settings import RunSettings

SETTING = RunSettings(backend="torch", budget=8, topk=4, batch=3, page_size=16, max_new_tokens=8, stop_after=1)


def _walk_with_bonus_off_by_one(tree, predicts):
    """The greedy walk, its bonus token one id higher (a wrong emission the oracle's stream sees)."""
    acc = greedy_walk(tree, predicts)
    return Acceptance(acc.rows, acc.bonus + 1)


def test_an_acceptance_bug_at_page_size_16_is_not_explained_by_the_verify_inputs():
    base = prepare(SETTING)
    p = derive(base, pipeline=replace(base.engine.pipeline, accept=_walk_with_bonus_off_by_one))
    s = check(p, RecordWriter(None))
    assert s.verdict == "diverge" and s.first is not None
    assert s.stage != "verify inputs", s.explanation
    assert "kv_indices" not in (s.explanation or ""), s.explanation
