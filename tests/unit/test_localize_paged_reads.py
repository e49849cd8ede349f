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


def test_an_out_cache_loc_of_another_length_than_the_rows_is_a_wrong_quantity_not_an_index_error():
    """A placement mutant handed the kernel 33 slots for 17 rows: the audit raised IndexError (an internal error)."""
    from types import SimpleNamespace

    import torch

    from harness.check.localize.metadata_audit import _out_cache_loc
    from harness.engine.ddtree.tree import DraftTree
    tree = DraftTree((5, 6, 7), (None, 0, 1), (0, 1, 2), q_len=4)
    for got in (torch.arange(100, 109), torch.arange(100, 102)):   # [9] and [2] slots for 4 rows
        result = SimpleNamespace(step=0, batch=SimpleNamespace(q_len=4, attn=SimpleNamespace(out_cache_loc=got)),
                                 requests=[SimpleNamespace(rid=0, row_slots=(100, 101, 102, 103))])
        (wrong,) = _out_cache_loc(result, [tree], {}, None)
        assert wrong.quantity == "out_cache_loc" and f"{got.numel()} slots for the batch's 4 rows" in wrong.text
