"""The drafter's guide (each prompt's greedy continuation by the target) comes from the dense oracle, not from the
engine's own model, backend and pool (harness/check/prepare.py guide_drafts_by_the_oracle): a bug there must not
reach the drafter, which is not under test (issue 21: a crashing backend crashed the guide too, so no replacement
of the engine's attention let the run go on)."""
from __future__ import annotations

import pytest

import harness.engine.dense as dense
from harness.check.prepare import prepare
from harness.engine.settings import RunSettings

SETTING = RunSettings(backend="torch", budget=8, topk=2, batch=2, max_new_tokens=8, stop_after=1)


def test_the_guide_is_the_oracles_greedy_and_never_runs_the_engines_dense_forward(monkeypatch):
    def broken(*args, **kwargs):
        raise AssertionError("the engine's dense greedy ran for the drafter")
    monkeypatch.setattr(dense, "dense_greedy", broken)
    p = prepare(SETTING)
    first = next(p.engine.rounds())   # the prefill computes each request's guide
    n = SETTING.max_new_tokens + SETTING.block_size
    for r in p.engine.requests:
        assert r.continuation == p.oracle.greedy(list(r.prompt), n)[0]
        assert len(r.continuation) == n
    assert first.step == 0


@pytest.mark.parametrize("tp", [2])
def test_under_tp_the_ranks_guide_themselves(tp):
    from harness.check.prepare import guide_drafts_by_the_oracle

    class Engine:
        pass
    e = Engine()
    guide_drafts_by_the_oracle(e, RunSettings(backend="torch", tp=tp), loaded=None)
    assert not hasattr(e, "_greedy_continuation")
