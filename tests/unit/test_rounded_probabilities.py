"""The oracle's low-precision computation rounds attention's probabilities
where a flash-style kernel stores them (SGLang's Triton kernels round
exp(s - max) to the value dtype before P @ V), and the check asks for it
exactly when the engine's kernel does."""
from __future__ import annotations

import torch

from harness.check.prepare import prepare
from harness.engine.settings import RunSettings
from reference import DenseOracle
from reference.model import attention, rounding_to

from tests.unit.test_reference_oracle import CFG, random_weights


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(5, 4, 8, generator=g, dtype=torch.float64)      # [T, heads, d]
    k = torch.randn(9, 2, 8, generator=g, dtype=torch.float64)      # [S, kv_heads, d]
    v = torch.randn(9, 2, 8, generator=g, dtype=torch.float64)
    visible = torch.ones(5, 9, dtype=torch.bool).tril(4)             # [T, S]
    return q, k, v, visible


def test_an_exact_probability_store_is_the_softmax():
    q, k, v, visible = _inputs()
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    for s in (None, sinks):
        plain = attention(q, k, v, visible, s)
        flash = attention(q, k, v, visible, s, probs_store=lambda x: x)
        assert torch.allclose(plain, flash, rtol=0, atol=1e-12)


def test_a_rounding_probability_store_moves_the_output_by_about_the_dtype_s_step():
    q, k, v, visible = _inputs()
    plain = attention(q, k, v, visible)
    stored = attention(q, k, v, visible, probs_store=rounding_to(torch.bfloat16))
    rel = ((stored - plain).abs().max() / plain.abs().max()).item()
    assert 1e-5 < rel < 2 ** -6


def test_the_oracle_rounds_probabilities_only_when_asked():
    oracle = DenseOracle(CFG, random_weights(CFG))
    tree = ([3, 7, 9, 11], [-1, 0, 0, 1])
    plain = oracle.rounded_tree_logits([1, 2, 5], *tree, "bfloat16")
    again = oracle.rounded_tree_logits([1, 2, 5], *tree, "bfloat16", False)
    probs = oracle.rounded_tree_logits([1, 2, 5], *tree, "bfloat16", True)
    assert torch.equal(plain, again)
    assert not torch.equal(plain, probs)
    exact = oracle.tree_logits([1, 2, 5], *tree)
    assert ((probs - exact).abs().max() / exact.abs().max()).item() < 0.1


def test_the_check_asks_for_the_kernel_s_rounding():
    p = prepare(RunSettings(backend="torch", dtype="bfloat16", max_new_tokens=2))
    assert p.engine.kernel.probability_dtype is None and not p.rounded_probabilities
    p.engine.kernel.probability_dtype = torch.bfloat16   # a kernel that stores P in bf16 before P @ V
    assert p.rounded_probabilities
