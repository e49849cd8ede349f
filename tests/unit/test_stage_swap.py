"""A stage proven guilty by replacing its output at the first divergent step
(harness/check/localize/stage_swap.py; issue 21 point 3): each rung on the
tiny preset, against a stage broken in the pipeline (never the thing
checked: the replacement is compared with the oracle)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness.check.differential import check
from harness.check.localize import stage_swap
from harness.check.localize.stage_swap import independent_batch, proven, prove_crash, prove_divergent_step
from harness.check.prepare import derive, prepare
from harness.check.records import RecordWriter
from harness.engine.ddtree.commit import commit_kv
from harness.engine.ddtree.verify_inputs import build_verify_batch
from harness.engine.settings import RunSettings
from tests.unit.test_localize_replace import _ScaleOff   # the backend with its softmax scale 3% off

SETTING = RunSettings(backend="torch", budget=8, topk=2, batch=2, max_new_tokens=8, stop_after=1)


def _commit_short(req_to_token, allocator, req, seq_len, row_slots, acc):
    """The committed length one short of the accepted rows (the bonus's row kept out)."""
    return commit_kv(req_to_token, allocator, req, seq_len, row_slots, acc) - 1


def _inputs_short(trees, seq_lens, *args, **kwargs):
    """The verify inputs read one prefix position too few."""
    return build_verify_batch(trees, [n - 1 for n in seq_lens], *args, **kwargs)




class _RaisesOnMask(_ScaleOff):
    def forward(self, q, k, v, layer, kb, vb, meta, *args, **kwargs):
        if meta.custom_mask is not None:
            raise RuntimeError("kernel launch failed")
        return self.inner.forward(q, k, v, layer, kb, vb, meta, *args, **kwargs)


@pytest.fixture(scope="module")
def base():
    return prepare(SETTING)


def _proof(base, **stages):
    p = derive(base, pipeline=replace(base.engine.pipeline, **stages))
    s = check(p, RecordWriter(None), localize=False)
    assert s.first is not None and s.first.what == "node", s.first
    return prove_divergent_step(p, s.first.step)


def test_a_commit_bug_is_proven_by_the_cache_rebuilt_from_the_ids(base):
    found = _proof(base, commit=_commit_short)
    assert proven(found).stage == "commit", [r.sentence() for r in found]
    assert found[0].error_before > 1 >= found[0].error_after


def test_a_verify_inputs_bug_is_proven_by_the_independent_batch(base):
    found = _proof(base, build_verify_batch=_inputs_short)
    assert [r.stage for r in found] == ["commit", "verify inputs"], [r.sentence() for r in found]
    assert not found[0].correct and found[0].error_after > 1 and found[1].correct


def test_an_attention_bug_is_proven_by_the_float64_attention(base):
    found = _proof(base, attention=_ScaleOff)
    assert [(r.stage, r.correct) for r in found] == [("commit", False), ("verify inputs", False),
                                                      ("attention", True)], [r.sentence() for r in found]


def test_a_graph_replay_bug_is_proven_by_the_eager_forward(base):
    """A graph run whose replay sees a causal mask (the catalog's graph-captured-causal): the eager run of the
    same setting matches at the step; the rungs before it do not."""
    p = derive(base, replace(SETTING, cuda_graph=True, fault="graph-captured-causal"))
    s = check(p, RecordWriter(None), localize=False)
    found = prove_divergent_step(p, s.first.step)
    assert [(r.stage, r.correct) for r in found] == [("commit", False), ("verify inputs", False),
                                                      ("attention", False), ("graph", True)], \
        [r.sentence() for r in found]


def test_an_attention_bug_under_graphs_is_the_attentions_not_the_graphs(base):
    """The narrower replacement first: the eager forward would run the same broken backend's eager path, the
    float64 attention replaces the backend alone."""
    p = derive(base, replace(SETTING, cuda_graph=True), pipeline=replace(base.engine.pipeline, attention=_ScaleOff))
    s = check(p, RecordWriter(None), localize=False)
    found = prove_divergent_step(p, s.first.step)
    assert proven(found).stage == "attention" and "graph" not in [r.stage for r in found], \
        [r.sentence() for r in found]


def test_the_stand_in_computes_its_own_scale_and_a_wrong_sm_scale_is_the_attentions(base, monkeypatch, tmp_path):
    """A softmax scale 3% off in LayerAttention.sm_scale (what every backend calls): the float64 stand-in,
    which computes the scale itself, makes the step correct; the run names the attention stage even where
    an audit saw only the model's outputs wrong (a cached K/V of a later layer)."""
    from harness.engine.attn.base import LayerAttention
    real = LayerAttention.sm_scale
    monkeypatch.setattr(LayerAttention, "sm_scale", lambda self, d: 1.03 * real(self, d))
    p = derive(base)
    s = check(p, RecordWriter(tmp_path / "r.jsonl"))
    assert not s.passed and s.stage == "attention", (s.stage, s.quantity, s.explanation)
    assert any(r["stage"] == "attention" and r["correct"] for r in s.replacements), s.replacements


def test_the_independent_batch_is_the_engines_on_a_correct_run(base):
    """Laid out from the trees and ids alone, it equals the verify-inputs stage's batch where that is right."""
    p = derive(base)
    seen = []
    own = p.engine.pipeline.build_verify_batch

    def both(*args):
        vb = own(*args)
        seen.append((vb, independent_batch(p.engine, *args)))
        return vb
    p.engine.pipeline = replace(p.engine.pipeline, build_verify_batch=both)
    next(iter(p.engine.rounds()))
    (vb, ours), = seen
    for name in ("input_ids", "positions", "seq_lens"):
        assert torch.equal(getattr(vb, name), getattr(ours, name)), name
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "custom_mask", "mask_indptr"):
        assert torch.equal(getattr(vb.attn, name), getattr(ours.attn, name)), name


def test_a_crash_in_the_attention_kernel_is_proven_by_the_float64_attention(base):
    p = derive(base, pipeline=replace(base.engine.pipeline, attention=_RaisesOnMask))
    s = check(p, RecordWriter(None))
    assert s.first.what == "proven-crash" and s.verdict == "diverge"
    assert [(r["stage"], r["correct"]) for r in s.replacements] == [("tree build", False), ("mask", False),
                                                                      ("verify inputs", False), ("attention", True)], s.replacements
    assert s.stage == "attention" and s.quantity == "crash" and "by replacement" in s.explanation


def test_a_crash_in_the_graph_replay_is_proven_by_the_eager_forward(base, monkeypatch):
    from harness.engine.graph import GraphRunner

    def broken(self, vb):
        raise RuntimeError("the expanded size of the tensor must match")
    monkeypatch.setattr(GraphRunner, "verify", broken)
    p = derive(base, replace(SETTING, cuda_graph=True))
    found = prove_crash(p, 0)
    assert [(r.stage, r.correct) for r in found] == [("tree build", False), ("mask", False), ("verify inputs", False),
                                                 ("attention", False), ("graph", True)], \
        [r.sentence() for r in found]
    assert found[-1].error_before is None and found[-1].error_after <= 1


def test_a_rung_that_replaces_nothing_proves_nothing(base, monkeypatch):
    """Break-check of the rungs' independence: a rung whose replacement does nothing leaves the step wrong."""
    monkeypatch.setattr(stage_swap, "rebuild_committed", lambda engine: None)
    found = _proof(base, commit=_commit_short)
    assert not found[0].correct and found[0].error_after > 1


def test_a_proof_replaces_the_audits_stage_only_where_the_evidence_refutes_it():
    from harness.check.differential import proof_overrides
    from harness.check.localize.stage_swap import Replacement
    ladder = [Replacement("commit", "x", 0, 5.0, 4.0, False, ""), Replacement("verify inputs", "x", 0, 5.0, 3.0, False, ""),
              Replacement("graph", "x", 0, 5.0, 0.01, True, "")]
    assert proof_overrides(None, ladder) and proof_overrides("model", ladder)
    assert proof_overrides("verify inputs", ladder)   # its own replacement left the step wrong
    assert not proof_overrides("accept", ladder)       # never replaced: the audit's measured quantity stands
    assert not proof_overrides("graph", ladder)
