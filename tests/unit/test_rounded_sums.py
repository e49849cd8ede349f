"""The oracle's rounded yardstick sums its matmuls in float64, as the noise-floor rule was fit to.

Summing them in float32 (each product of two stored values is exact there) was tried to halve the CPU cost of
the rounded pass: on SmolLM2-135M in bf16 it made the rounded error about 5% larger at the median (a float32 sum
adds its own rounding to the stored values'), and the one-key leaks near the bound were caught on 38 nodes
against 46, one run of 12 not at all (benchmarks/README.md, yardstick_agreement.py). The float64 model and the
rounded one share every sum's arithmetic; only the stores differ."""
from __future__ import annotations

import torch

from reference.model import DenseLlama

from tests.unit.test_reference_oracle import CFG, random_weights


def test_the_rounded_model_sums_in_float64_and_rounds_only_its_stores():
    model = DenseLlama(CFG, random_weights(CFG))
    low = model.rounded(torch.bfloat16)
    x = low.store(torch.randn(3, CFG.hidden_size, dtype=torch.float64))        # [3, hidden] stored values
    name = "model.layers.0.mlp.gate_proj"
    w = low._weight(name + ".weight")                                          # [out, hidden] rounded, float64
    assert torch.equal(low._linear(x, name), low.store(x @ w.T))               # a float64 sum, then the store
    stores = low.store
    low.store = lambda t: t    # the sum itself (the rounded weight is held already): float64, not float32's
    assert torch.equal(low._linear(x, name), x @ w.T)
    assert not torch.equal(low._linear(x, name), (x.float() @ w.float().T).double())
    low.store = stores
