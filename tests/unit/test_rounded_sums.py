"""The oracle's rounded yardstick sums its matmuls in float32 where its float32 weights fit (reference/model.py):
its operands are values of the rounded dtype, so every product is exact and only the sum's rounding differs from a
float64 sum, far under one step of the dtype on a 2-layer model. The float64 model sums in float64."""
from __future__ import annotations

import torch

from reference import DenseOracle
from reference.model import DenseLlama

from tests.unit.test_reference_oracle import CFG, random_weights

PREFIX, TOKENS, PARENTS = [1, 2, 5, 7, 3], [4, 9, 2, 6], [-1, 0, 0, 1]


def test_the_float64_model_sums_in_float64_a_rounded_one_in_float32():
    model = DenseLlama(CFG, random_weights(CFG))
    low = model.rounded(torch.bfloat16)
    x = low.store(torch.randn(3, CFG.hidden_size, dtype=torch.float64))        # [3, hidden] stored values
    name = "model.layers.0.mlp.gate_proj.weight"
    assert torch.equal(model._matmul(x, name), x @ model.w[name].T)
    w = low._weight(name)                                                      # [out, hidden] rounded, float64
    got = low._matmul(x, name)
    assert got.dtype == torch.float64 and torch.equal(got, (x.float() @ w.float().T).double())
    wide = x @ w.T
    assert 0 < (got - wide).abs().max() <= 1e-6 * wide.abs().max()           # a float32 sum, not a float64 one


def test_float32_sums_leave_the_rounded_logits_within_a_step_of_the_float64_sums(monkeypatch):
    oracle = DenseOracle(CFG, random_weights(CFG))
    exact = oracle.tree_logits(PREFIX, TOKENS, PARENTS)                        # [4, V] float64
    summed32 = oracle.rounded_tree_logits(PREFIX, TOKENS, PARENTS, "bfloat16")
    wide = DenseOracle(CFG, random_weights(CFG))
    monkeypatch.setattr(DenseLlama, "_matmul", lambda self, x, name: x @ self._weight(name).T)
    summed64 = wide.rounded_tree_logits(PREFIX, TOKENS, PARENTS, "bfloat16")
    scale = exact.abs().amax(-1)                                               # [4]
    step = 2.0 ** -8 * scale                                                   # one bf16 step of the largest logit
    assert ((summed32 - summed64).abs().amax(-1) <= 2 * step).all()
    e32, e64 = ((x - exact).abs().amax(-1) / scale for x in (summed32, summed64))
    assert (e32 > 0).all() and ((e32 - e64).abs() <= 0.25 * e64).all()        # the yardstick's error as before


def test_without_room_for_float32_weights_the_sums_stay_float64(monkeypatch):
    """Widening a weight to float32 at every use would cost more than the float32 sum saves: where the copies do
    not fit beside the float64 weights, a rounded model sums in float64 and holds no float32 copy."""
    import reference.model as ref_model
    monkeypatch.setattr(ref_model, "_room_for", lambda nbytes, device: False)
    low = DenseLlama(CFG, random_weights(CFG)).rounded(torch.bfloat16)
    x = low.store(torch.randn(3, CFG.hidden_size, dtype=torch.float64))
    name = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(low._matmul(x, name), x @ low._weight(name).T) and low.summed_w == {}
