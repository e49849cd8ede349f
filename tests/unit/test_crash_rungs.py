"""The accept and model crash rungs (harness/check/localize/crash_rungs.py; issue 21): a crash of the engine's
acceptance (its walk, its cross-checked acceptor, or an acceptance the commit raises on) is proven `accept`, a
raise of the model's own code (llama.py) is proven `model`, and a crash of any other stage is not laid on
either, on the tiny preset with planted stages."""
from __future__ import annotations

from dataclasses import replace

import pytest

from harness.check.crash import PROVEN_CRASH
from harness.check.differential import check
from harness.check.localize import crash_rungs
from harness.check.localize.crash_rungs import walked_acceptance
from harness.check.localize.stage_swap import _judged_step
from harness.check.prepare import derive, prepare
from harness.check.records import RecordWriter
from harness.engine.ddtree.accept import Acceptance, greedy_walk
from harness.engine.model.llama import LlamaModel
from harness.engine.settings import RunSettings
from tests.unit.test_proven_crash import _commit_raises, _stop_raises

SETTING = RunSettings(backend="torch", budget=8, topk=2, batch=2, max_new_tokens=8, stop_after=0)
BEFORE = ["tree build", "mask", "verify inputs", "attention"]   # the rungs before these (no graph)


@pytest.fixture(scope="module")
def base():
    return prepare(replace(SETTING, stop_after=1))


def _check(base, **stages):
    p = derive(base, SETTING, pipeline=replace(base.engine.pipeline, **stages))
    return check(p, RecordWriter(None))


def _walk_raises(tree, predicts):
    raise IndexError("list index out of range")


def _walk_returns_nothing(tree, predicts):
    """greedy_walk's `while True:` -> `while not True:`: no acceptance; the commit raises on it."""
    return None


def _walk_from_row_1(tree, predicts):
    """greedy_walk's `rows = [0]` -> `[1]`: the Acceptance's own check raises."""
    return Acceptance((1,), predicts[0])


@pytest.mark.parametrize("accept", [_walk_raises, _walk_returns_nothing, _walk_from_row_1])
def test_an_acceptance_that_raises_or_that_the_commit_raises_on_is_proven_accept(base, accept):
    s = _check(base, accept=accept)
    assert s.crash["side"] == "engine", s.crash
    assert [r["stage"] for r in s.replacements] == BEFORE + ["accept"], s.replacements
    assert s.replacements[-1]["correct"] and not any(r["correct"] for r in s.replacements[:-1])
    assert s.first.what == PROVEN_CRASH and s.first.step == 0 and s.stage == "accept", s.explanation
    assert "accept stage replaced by the oracle's greedy walk" in s.first.detail


def test_a_cross_checked_acceptor_that_raises_is_proven_accept(base, monkeypatch):
    """The acceptor run beside the walk for comparison (SGLang's, where installed) raises: the rung runs the
    oracle's walk alone."""
    import harness.engine.loop as loop

    def sglang_raises(tree, predicts):
        raise TypeError("unsupported operand type(s) for |: 'list' and 'int'")
    monkeypatch.setattr(loop, "pick_acceptors", lambda accept, walk: (walk, sglang_raises))
    s = _check(base)
    assert "unsupported operand" in s.crash["error"], s.crash
    assert [r["stage"] for r in s.replacements] == BEFORE + ["accept"] and s.replacements[-1]["correct"]
    assert s.first.what == PROVEN_CRASH and s.stage == "accept"


def test_a_commit_that_raises_is_still_the_commits(base):
    s = _check(base, commit=_commit_raises)
    assert [(r["stage"], r["correct"]) for r in s.replacements][-2:] == [("accept", False), ("commit", True)]
    assert s.stage == "commit" and s.first.what == PROVEN_CRASH


def test_the_walked_acceptance_is_the_engines_on_a_correct_run(base):
    """The oracle's walk over the engine's argmax gives the engine's own walk, request by request, every round
    (so a crash elsewhere meets the same acceptance under the rung)."""
    p = derive(base, SETTING)
    seen = []
    own = p.engine.accept_request

    def both(tree, predicts, b, trees):
        acc = own(tree, predicts, b, trees)
        q = tree.q_len
        seen.append((acc, walked_acceptance(p.oracle, tree, predicts[b * q:(b + 1) * q], p.engine.cfg.vocab_size)))
        return acc
    p.engine.accept_request = both
    list(p.engine.rounds())
    assert len(seen) > SETTING.batch and any(len(a.rows) > 1 for a, _ in seen)
    assert all(a.rows == w.rows and a.bonus == w.bonus for a, w in seen), seen
    assert greedy_walk is p.engine.pipeline.accept


def _model_raises(at_verify_only: bool):
    """A raise in the model's own code (llama.py's forward calls it), as its arithmetic mutants raise:
    TypeError: unsupported operand type(s) for &: 'Tensor' and 'Tensor'."""
    real = LlamaModel._window_meta

    def window_meta(self, meta, positions):
        if meta.custom_mask is not None or not at_verify_only:
            raise TypeError("unsupported operand type(s) for &: 'Tensor' and 'Tensor'")
        return real(self, meta, positions)
    return window_meta


# trees narrower than the verify width (depth 3, one child each: 4 of 9 rows real): padding rows in every step
PADDED = replace(SETTING, topk=1, block_size=4)


@pytest.mark.parametrize("at_verify_only, setting", [(True, SETTING), (False, SETTING), (True, PADDED)])
def test_a_raise_of_the_models_own_code_is_proven_model(base, monkeypatch, at_verify_only, setting):
    """At the verify only (step 0 raises), or at every forward (the prefill raises: no step produced); the
    replaced forward's padding rows are finite."""
    monkeypatch.setattr(LlamaModel, "_window_meta", _model_raises(at_verify_only))
    s = check(derive(base, setting), RecordWriter(None))
    assert s.crash["side"] == "engine" and s.crash["where"].startswith("harness/engine/model/llama.py"), s.crash
    assert [r["stage"] for r in s.replacements] == BEFORE + ["accept", "commit", "KV allocation", "model"], s.replacements
    assert s.replacements[-1]["correct"] and not any(r["correct"] for r in s.replacements[:-1])
    assert s.first.what == PROVEN_CRASH and s.first.step == 0 and s.stage == "model", s.explanation
    assert "model stage replaced by the oracle's float64 forward" in s.first.detail


def test_a_crash_of_another_stage_is_neither_the_acceptances_nor_the_models(base):
    """The stop stage (replaced by no rung) raises every round: under the accept and the model rungs too."""
    s = _check(base, stop=_stop_raises)
    tried = {r["stage"]: r for r in s.replacements}
    assert not tried["accept"]["correct"] and not tried["model"]["correct"], s.replacements
    assert "NoneType" in tried["model"]["note"], tried["model"]
    assert s.first.what == "crash" and s.stage not in ("accept", "model")


class _KernelReadsPastThePool:
    """The verify's attention reads prefix slots past the pool: the torch backend's own code raises."""
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, q, k, v, layer, kb, vb, meta, *args, **kwargs):
        if meta.custom_mask is not None:
            meta = replace(meta, kv_indices=meta.kv_indices + kb.shape[0])
        return self.inner.forward(q, k, v, layer, kb, vb, meta, *args, **kwargs)


def test_the_model_rung_sets_aside_only_the_models_own_raise(base):
    """The attention backend's code raises inside the forward: the model rung lets it stand."""
    p = derive(base, SETTING, pipeline=replace(base.engine.pipeline, attention=_KernelReadsPastThePool))
    after, note, _ = _judged_step(p, 0, crash_rungs._oracle_forward_throughout)
    assert after is None and note.startswith("IndexError"), note


def test_a_model_rung_run_where_the_model_never_raised_proves_nothing(base):
    after, note, _ = _judged_step(derive(base, SETTING), 0, crash_rungs._oracle_forward_throughout)
    assert after is None and note.startswith("ModelNeverRaised"), note


def test_the_oracles_forward_matches_the_oracle_at_the_step(base, monkeypatch):
    """With the model's raise set aside, the replaced step is the oracle's own logits (well within its bound)."""
    monkeypatch.setattr(LlamaModel, "_window_meta", _model_raises(False))
    after, note, _ = _judged_step(derive(base, SETTING), 1, crash_rungs._oracle_forward_throughout)
    assert after is not None and after < 1e-3, (after, note)


def test_under_graphs_a_raise_of_the_models_own_code_is_the_models_not_the_graphs(base, monkeypatch):
    """The eager forward (the graph rung) runs the same model code and raises too; the model rung, eager itself,
    proves it."""
    monkeypatch.setattr(LlamaModel, "_window_meta", _model_raises(True))
    s = check(derive(base, replace(SETTING, cuda_graph=True)), RecordWriter(None))
    assert [(r["stage"], r["correct"]) for r in s.replacements][-6:] == [
        ("attention", False), ("graph", False), ("accept", False), ("commit", False), ("KV allocation", False),
        ("model", True)], s.replacements
    assert s.stage == "model" and s.first.what == PROVEN_CRASH
