"""A stage proven guilty by replacement (harness/check/localize/replace.py,
bookkeeping.py; issue 21 point 3): a run-level drift in bfloat16 is the
attention's when a float64 softmax of the same inputs in its place takes it
away, the model's when it stays; a loop that emits the root twice is the
accept stage's emission, not the model's K/V."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness.check.differential import check
from harness.check.localize.bookkeeping import audit_bookkeeping
from harness.check.localize.replace import ExactAttention
from harness.check.prepare import derive, prepare
from harness.check.records import RecordWriter
from harness.engine.attn.torch_backend import TorchBackend
from harness.engine.model import llama
from harness.engine.settings import RunSettings

BF16 = RunSettings(backend="torch", budget=8, topk=2, batch=2, dtype="bfloat16", max_new_tokens=10, stop_after=1)


class _ScaleOff:
    """The torch backend with its softmax scale 3% off (q scaled: the same scores)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, q, *args, **kwargs):
        return self.inner.forward(q * 1.03, *args, **kwargs)


def _checked(tmp_path, p):
    return check(p, RecordWriter(tmp_path / "r.jsonl"))


@pytest.fixture(scope="module")
def bf16():
    return prepare(BF16)


def test_a_drift_the_exact_attention_removes_is_the_attentions(tmp_path, bf16):
    p = derive(bf16, pipeline=replace(bf16.engine.pipeline, attention=_ScaleOff))
    s = _checked(tmp_path, p)
    assert s.first.what == "drift" and s.stage == "attention" and s.quantity == "attention_output"
    assert "replaced by a float64 softmax" in s.explanation


def test_a_drift_the_exact_attention_keeps_is_the_models(tmp_path, bf16, monkeypatch):
    mlp = llama.LlamaModel._mlp

    def mlp_off(self, p, x):   # the MLP's output 3% large, on the engine's side only
        return mlp(self, p, x) * 1.03
    monkeypatch.setattr(llama.LlamaModel, "_mlp", mlp_off)
    s = _checked(tmp_path, derive(bf16))
    assert s.first.what == "drift" and s.stage == "model forward", s.explanation
    assert "not the attention" in s.explanation


def test_the_exact_attention_agrees_with_the_torch_backend_in_float64():
    torch.manual_seed(0)
    from harness.engine.ddtree.verify_inputs import AttnMetadata
    from harness.engine.ddtree.mask import flat_custom_mask
    from harness.engine.ddtree.tree import DraftTree
    tree = DraftTree(tokens=(1, 2, 3, 4), parents=(None, 0, 0, 1), depths=(0, 1, 1, 2), q_len=4)
    mask, indptr = flat_custom_mask([tree, tree], [3, 5])
    meta = AttnMetadata(qo_indptr=torch.tensor([0, 4, 8]), kv_indptr=torch.tensor([0, 3, 8]),
                        kv_indices=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]), out_cache_loc=torch.arange(8, 16),
                        custom_mask=mask, mask_indptr=indptr, max_len_extend=4)
    q, k, v = (torch.randn(8, 4, 8, dtype=torch.float64) for _ in range(3))
    kb, vb = torch.randn(16, 2, 8, dtype=torch.float64), torch.randn(16, 2, 8, dtype=torch.float64)
    torch_out = TorchBackend("cpu", torch.float64).forward(q, k[:, :2], v[:, :2], 0, kb, vb, meta)
    exact = ExactAttention(TorchBackend("cpu", torch.float64)).forward(q, k[:, :2], v[:, :2], 0, kb, vb, meta)
    assert torch.allclose(torch_out, exact, atol=1e-6)


def _round(emitted, seq_len):
    """One request after a round that accepted rows [0, 1] (tokens 5, 6) with bonus 9 over prefix [1, 2, 3]."""
    from types import SimpleNamespace as NS
    from harness.engine.ddtree.accept import Acceptance
    from harness.engine.ddtree.tree import DraftTree
    tree = DraftTree(tokens=(5, 6, 7), parents=(None, 0, 0), depths=(0, 1, 1), q_len=3)
    rs = NS(rid=0, step=4, prefix=(1, 2, 3), tree=tree, acceptance=Acceptance((0, 1), 9))
    engine = NS(requests=[NS(rid=0, prompt=[1, 2, 3], emitted=emitted, seq_len=seq_len)])
    return audit_bookkeeping(engine, NS(requests=(rs,)))


def test_emission_and_length_are_checked_against_the_acceptance():
    assert _round([5, 6, 9], 5) == []
    (w,) = _round([5, 5, 6, 9], 5)   # the root emitted twice
    assert (w.stage, w.quantity, w.step, w.index) == ("accept", "emitted", 4, 1)
    (w,) = _round([5, 6, 9], 4)      # the length one short
    assert (w.stage, w.quantity, w.expected, w.found) == ("commit", "seq_len", 5, 4)
