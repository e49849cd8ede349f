"""The per-step comparison at scale: every row of a step compared in one pass
(compare_rows) and every leaf's twin in one extend batch give what the
obvious per-node computations give."""
from __future__ import annotations

import pytest
import torch

from harness.check.prepare import prepare
from harness.check.compare.metrics import compare_node, compare_rows
from harness.engine.ddtree.verify_inputs import prefill_metadata
from harness.engine.mem.pool import KVPool
from harness.check.causal_twin import CausalTwin
from harness.engine.settings import RunSettings


def one_by_one(e: torch.Tensor, r: torch.Tensor):
    """The metrics of one row, written out plainly."""
    e = e.double()
    finite = bool(torch.isfinite(e).all())
    scale = max(float(r.abs().max()), 1e-30)
    s = sorted(r.tolist(), reverse=True)
    gap = (s[0] - s[1]) / scale
    if not finite:
        return float("inf"), False, float("inf"), gap, False, scale
    p = torch.softmax(r, -1)
    kl = float((p * (torch.log_softmax(r, -1) - torch.log_softmax(e, -1))).sum())
    return float((e - r).abs().max()) / scale, int(e.argmax()) == int(r.argmax()), max(kl, 0.0), gap, True, scale


def test_compare_rows_equals_the_row_by_row_metrics():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(6, 300, generator=g, dtype=torch.float64) * 4
    eng = (ref + torch.randn(6, 300, generator=g, dtype=torch.float64) * 0.05).to(torch.bfloat16)
    eng[2, 7] = float("nan")
    eng[4] = ref[4].flip(0).to(torch.bfloat16)              # a row whose argmax moved
    got = compare_rows(eng, ref)
    for i, m in enumerate(got):
        want = one_by_one(eng[i], ref[i])
        assert (m.rel_err, m.top1_agree, m.finite) == (pytest.approx(want[0], rel=1e-12), want[1], want[4])
        assert m.kl == pytest.approx(want[2], rel=1e-9, abs=1e-15)
        assert (m.ref_gap, m.ref_scale) == (pytest.approx(want[3], rel=1e-12), pytest.approx(want[5], rel=1e-12))
        assert compare_node(eng[i], ref[i]) == m
    assert not got[2].finite and got[2].rel_err == float("inf") and not got[4].top1_agree


def test_compare_rows_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="n, vocab"):
        compare_rows(torch.zeros(3, 5), torch.zeros(2, 5, dtype=torch.float64))
    assert compare_rows(torch.zeros(0, 5), torch.zeros(0, 5, dtype=torch.float64)) == []


def per_node_twin(model, backend, prefix, tree, row) -> torch.Tensor:
    """Node `row`'s twin by its definition: one causal extend of prefix + its root path, fresh pool."""
    ids = list(prefix) + [tree.tokens[i] for i in tree.ancestors(row)]
    pool = KVPool(model.cfg, len(ids) + 1, model.dtype, "cpu")
    meta = prefill_metadata([len(ids)], torch.arange(1, len(ids) + 1))
    return model.forward(torch.tensor(ids), torch.arange(len(ids)), meta, pool, backend)[-1].float()


@pytest.mark.parametrize("backend,model,topk", [("torch", "tiny", 3), ("torch", "tiny-swa", 2),
                                                ("sglang-triton", "tiny", 2)])
def test_batched_twin_equals_each_nodes_own_causal_extend(backend, model, topk):
    extra = {"sliding_window": None} if model != "tiny-swa" else {}
    p = prepare(RunSettings(backend=backend, model=model, topk=topk, budget=8, block_size=4, max_new_tokens=4,
                            batch=2, verdict="fixed", **extra))
    twin = CausalTwin(p.engine.model, p.engine.kernel, "cpu", 8)    # a small pool: the twin grows it
    checked = 0
    for result in p.engine.rounds():
        for rs in result.requests:
            got = twin.tree_logits(rs.prefix, rs.tree)                      # [num_rows, vocab]
            assert got.shape[0] == rs.tree.num_rows
            for row in range(rs.tree.num_rows):
                want = per_node_twin(p.engine.model, p.engine.kernel, rs.prefix, rs.tree, row)
                assert torch.allclose(got[row], want, rtol=1e-4, atol=1e-4), (rs.step, rs.rid, row)
                checked += 1
        if checked > 24:
            break
    assert checked > 12
