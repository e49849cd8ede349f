"""A crash of the engine under test whose stage a replacement proves (the step rerun with that stage's output
replaced runs and matches the oracle) is a divergence of that step: the summary's first divergence is a
`proven-crash` naming the step and the stage, the crash its evidence. A crash no replacement makes right stays a
`crash` (issue 21: a kernel call that kills its process, a graph bucket smaller than the batch)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from harness.check.crash import PROVEN_CRASH
from harness.check.differential import check
from harness.check.prepare import derive, prepare
from harness.check.records import RecordWriter
from harness.check.summary import summary_record
from harness.cli.watchdog import add_proof
from harness.engine.attn.torch_backend import TorchBackend
from harness.engine.settings import RunSettings

SETTING = RunSettings(backend="torch", budget=8, topk=2, batch=2, max_new_tokens=8, stop_after=1)


class _KernelRaisesAtStep1(TorchBackend):
    """The verify kernel raises from its second verify call on (a batch the first never showed it)."""
    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, q, k, v, layer, kb, vb, meta, *args, **kwargs):
        if meta.custom_mask is not None and layer == 0:
            self.calls += 1
        if meta.custom_mask is not None and self.calls > 1:
            raise RuntimeError("an illegal memory access was encountered")
        return self.inner.forward(q, k, v, layer, kb, vb, meta, *args, **kwargs)


def _commit_raises(*args, **kwargs):
    raise IndexError("index 99 is out of bounds for dimension 0 with size 2")


def _stop_raises(tree, acceptance, eos_id):
    raise TypeError("'NoneType' object is not subscriptable")


@pytest.fixture(scope="module")
def base():
    return prepare(SETTING)


def _run(base, **stages):
    p = derive(base, replace(SETTING, stop_after=0), pipeline=replace(base.engine.pipeline, **stages))
    w = RecordWriter(None)
    s = check(p, w)
    return s, [json.loads(x) for x in w.lines]


def test_a_crash_the_attention_replacement_proves_is_a_divergence_of_its_step(base):
    s, records = _run(base, attention=_KernelRaisesAtStep1)
    assert s.crash["side"] == "engine" and s.crash["step"] == 0, s.crash   # produced step 0, raised in step 1
    assert s.first.what == PROVEN_CRASH and s.first.step == 1, s.first
    assert "no logits at step 1" in s.first.detail and "illegal memory access" in s.first.detail
    assert "attention stage replaced" in s.first.detail and "matches the oracle" in s.first.detail
    assert s.verdict == "diverge" and s.stage == "attention" and s.fault_class == "crash"
    assert any(r["kind"] == "crash" for r in records)   # the crash record stays: the evidence
    summary = records[-1]
    assert summary["first"]["what"] == PROVEN_CRASH and summary["first"]["step"] == 1


def test_a_crash_no_replacement_makes_right_stays_a_crash(base):
    """The stop stage (no rung replaces it) raises on every run: every replaced run raises too, nothing is
    proven."""
    s, _ = _run(base, stop=_stop_raises)
    assert s.crash["side"] == "engine"
    assert s.replacements and not any(r["correct"] for r in s.replacements), s.replacements
    assert s.first.what == "crash" and s.verdict == "diverge"


def test_without_the_localizer_a_crash_stays_a_crash(base):
    p = derive(base, pipeline=replace(base.engine.pipeline, attention=_KernelRaisesAtStep1))
    s = check(p, RecordWriter(None), localize=False)
    assert s.first.what == "crash" and not s.replacements


def _killed_summary() -> dict:
    return {"kind": "summary", "verdict": "diverge", "explanation": "the engine under test raised ...",
            "first": {"step": -1, "request": -1, "node": -1, "depth": None, "padding_present": False,
                      "rel_err": None, "what": "crash", "detail": "the engine under test raised ..."},
            "crash": {"side": "engine", "where": "harness/engine/attn/torch_backend.py:33 (forward)",
                      "error": "the process died by SIGSEGV"}, "stage": "attention", "quantity": "crash"}


def test_a_killed_process_whose_float64_rerun_matches_is_a_proven_crash():
    summary = _killed_summary()
    add_proof(summary, {"passed": True, "max_rel_err": 1e-7, "tolerance": 1e-5, "verdict": "pass"})
    assert summary["first"]["what"] == PROVEN_CRASH and summary["stage"] == "attention"
    assert "SIGSEGV" in summary["first"]["detail"] and "matches the oracle" in summary["first"]["detail"]


@pytest.mark.parametrize("rerun", [None, {"passed": False, "crash": {"side": "engine"}, "verdict": "diverge"},
                                   {"passed": False, "max_rel_err": 1.0, "tolerance": 1e-5, "verdict": "diverge"}])
def test_a_killed_process_whose_rerun_crashes_or_diverges_stays_a_crash(rerun):
    summary = _killed_summary()
    add_proof(summary, rerun)
    assert summary["first"]["what"] == "crash"


def _tree_raises(root, draft_logprobs, budget, topk):
    raise IndexError("list index out of range")


def _mask_raises(trees, prefix_lens):
    raise IndexError("Dimension out of range (expected to be in range of [-1, 0], but got 1)")


def _inputs_raise(*args, **kwargs):
    raise TypeError("unsupported operand type(s) for <<: 'list' and 'list'")


@pytest.mark.parametrize("stages, proven_stage, tried", [
    (dict(build_tree=_tree_raises), "tree build", ["tree build"]),
    (dict(build_mask=_mask_raises), "mask", ["tree build", "mask"]),
    (dict(build_verify_batch=_inputs_raise), "verify inputs", ["tree build", "mask", "verify inputs"]),
    (dict(commit=_commit_raises), "commit", ["tree build", "mask", "verify inputs", "attention", "accept",
                                          "commit"]),
])
def test_a_crash_of_the_tree_the_mask_the_verify_inputs_or_the_commit_is_proven_by_their_independent_output(base, stages, proven_stage,
                                                                                         tried):
    """Each stage replaced from the start by its output rebuilt from the trees and token ids: the stage that
    crashed is the first whose replacement makes the step run and match; one upstream of it does not."""
    s, _ = _run(base, **stages)
    assert [r["stage"] for r in s.replacements] == tried, s.replacements
    assert s.replacements[-1]["correct"] and not any(r["correct"] for r in s.replacements[:-1])
    assert s.first.what == PROVEN_CRASH and s.first.step == 0 and s.stage == proven_stage, s.explanation


def test_the_independent_mask_is_the_mask_stages_on_a_correct_run(base):
    from harness.check.localize.stage_swap import independent_mask
    from harness.engine.ddtree.mask import flat_custom_mask
    p = derive(base)
    seen = []
    own = p.engine.pipeline.build_mask

    def both(trees, prefix_lens):
        seen.append((own(trees, prefix_lens), independent_mask(trees, prefix_lens)))
        return seen[-1][0]
    p.engine.pipeline = replace(p.engine.pipeline, build_mask=both)
    next(iter(p.engine.rounds()))
    ((mask, indptr), (ours, our_indptr)), = seen
    assert own is flat_custom_mask and mask.dtype == ours.dtype
    assert torch.equal(mask, ours) and torch.equal(indptr, our_indptr)


def test_a_commit_that_crashes_at_a_later_step_is_proven_over_the_rebuilt_cache(base):
    """The commit runs right at step 0 and raises at step 1: the replaced run's step 1 reads the cache the
    commit rung rebuilt from the ids after step 0, and matches the oracle there."""
    from harness.engine.ddtree.commit import commit_kv
    calls = []

    def commit_then_raise(*args):
        calls.append(1)
        if len(calls) > SETTING.batch:
            raise IndexError("index 99 is out of bounds for dimension 0 with size 2")
        return commit_kv(*args)
    s, _ = _run(base, commit=commit_then_raise)
    assert s.crash["step"] == 0 and s.first.what == PROVEN_CRASH and s.first.step == 1, (s.crash, s.first)
    assert s.stage == "commit" and s.replacements[-1]["stage"] == "commit", s.replacements


def test_the_reducer_keeps_a_proven_crash_and_its_crash_as_one_failure():
    from harness.workflows.reduce import failure_kind
    assert failure_kind("proven-crash", 0) == failure_kind("crash", 0) == "crash"
    assert failure_kind("node", 0) == "node"


def test_a_verify_width_off_the_tree_is_proven_by_the_oracles_tree_at_budget_plus_one(base):
    """The pipeline's verify width budget - 1 (a cosmic-ray mutant of pipeline.verify_width): the engine's
    trees are wider than its rows and the loop raises. The tree stage replaced, its width included, runs and
    matches; the engine's own width (any other rung) still raises."""
    p = derive(base, replace(SETTING, stop_after=0),
               pipeline=replace(base.engine.pipeline, width=lambda budget: budget - 1))
    s = check(p, RecordWriter(None))
    assert s.crash["side"] == "engine" and "verify width" in s.crash["error"], s.crash
    assert [r["stage"] for r in s.replacements] == ["tree build"] and s.replacements[0]["correct"]
    assert s.first.what == PROVEN_CRASH and s.stage == "tree build"
