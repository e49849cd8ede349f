"""The noise-floor verdict: each bf16 node judged against its correct
low-precision twin, not a fixed table."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness.check.differential import check

from harness.check.prepare import prepare
from harness.check.compare.metrics import compare_node
from harness.verdict.noise_floor import NOISE_FLOOR, NoiseFloorRule, verdict_rule
from harness.faults.one_key import ONE_KEY_LEAKS
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings, UsageError


def run(leak=None, **kw):
    s = RunSettings(**{"backend": "torch", "max_new_tokens": 10, "stop_after": 0, **kw})
    p = prepare(s)
    if leak:
        p.engine.pipeline = replace(p.engine.pipeline, build_mask=ONE_KEY_LEAKS[leak])
    w = RecordWriter(None)
    return check(p, w, localize=False), w


def test_rule_bound_and_ratio():
    r = NoiseFloorRule(multiplier=2.0, floor=0.01, ceiling=0.2)
    assert r.bound(0.03) == pytest.approx(0.06) and r.bound(0.001) == pytest.approx(0.02)
    assert r.bound(0.5) == 0.2 and r.ratio(0.06, 0.03) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        NoiseFloorRule(multiplier=0.5, floor=0.01, ceiling=0.2)


def test_which_runs_it_judges():
    assert verdict_rule("bfloat16", "auto", False) is NOISE_FLOOR["bfloat16"]
    assert verdict_rule("bfloat16", "auto", True) is None          # an explicit tolerance is a fixed verdict
    assert verdict_rule("float32", "auto", False) is None
    assert verdict_rule("float16", "fixed", False) is None
    with pytest.raises(UsageError, match="noise-floor"):
        RunSettings(dtype="float32", verdict="noise-floor")


def test_twin_is_a_correct_computation_of_each_node():
    """In float32 the twin of every node of a branching tree sits at float32
    noise from the oracle: it computes prefix + the node's own path."""
    p = prepare(RunSettings(backend="torch", topk=3, budget=8, block_size=4, max_new_tokens=6, batch=2,
                            verdict="fixed"))
    from harness.check.causal_twin import CausalTwin
    twin = CausalTwin(p.engine.model, p.engine.backend, "cpu", p.engine.max_context + p.engine.q_len)
    seen = 0
    for result in p.engine.rounds():
        for rs in result.requests:
            tree = rs.tree
            ref = p.oracle.tree_logits(list(rs.prefix), list(tree.tokens), [-1] + [int(x) for x in tree.parents[1:]])
            got = twin.tree_logits(rs.prefix, tree)
            assert got.shape == ref.shape
            assert max(compare_node(got[i], ref[i]).rel_err for i in range(tree.num_rows)) < 1e-4
            seen += tree.num_rows
    assert seen > 20


def test_a_correct_bf16_run_passes_with_ratios_recorded():
    summary, w = run(dtype="bfloat16", topk=2, batch=2)
    assert summary.passed and summary.verdict_rule == "noise-floor"
    assert summary.max_twin_err > 0 and summary.max_noise_ratio < NOISE_FLOOR["bfloat16"].multiplier
    nodes = [r for r in map(__import__("json").loads, w.lines) if r.get("kind") == "node" and not r["is_padding"]]
    assert nodes and all(r["twin_err"] is not None and r["noise_ratio"] is not None for r in nodes)


def test_one_leaked_padding_key_missed_by_the_fixed_table_is_caught():
    """tiny preset, bf16, 200-token prefix: the last real row seeing one
    padding column stays under the fixed 4e-2; against its twin it is over
    the multiplier."""
    fixed, _ = run("last-row-sees-one-padding", dtype="bfloat16", prompt_lens=(200,), verdict="fixed")
    noise, w = run("last-row-sees-one-padding", dtype="bfloat16", prompt_lens=(200,))
    assert fixed.divergent_nodes == 0 and fixed.max_rel_err < 4e-2
    assert noise.divergent_nodes > 0 and noise.max_noise_ratio > NOISE_FLOOR["bfloat16"].multiplier
    clean, _ = run(dtype="bfloat16", prompt_lens=(200,))
    assert clean.passed


def test_fp16_judges_by_its_own_multiplier_a_correct_branching_run_passes_a_leak_does_not():
    """fp16 ratios spread wider than bf16's (independent output rounding); its
    multiplier sits between the largest correct ratio and the weakest leak measured."""
    rule = NOISE_FLOOR["float16"]
    clean, _ = run(dtype="float16", topk=4, batch=4, max_new_tokens=16)
    assert clean.passed and clean.verdict_rule == "noise-floor" and clean.max_noise_ratio < rule.multiplier
    leak, _ = run("last-row-sees-one-padding", dtype="float16", prompt_lens=(300,))
    assert leak.divergent_nodes > 0 and leak.max_noise_ratio > rule.multiplier


def test_float32_on_cuda_is_ieee_unless_tf32_is_asked_for(monkeypatch):
    """The CPU twin of the CUDA path: the backend's declared precision follows
    TRITON_F32_DEFAULT, which float32_dots sets before any kernel compiles."""
    from harness.engine.attn.sglang_triton import SGLangTritonBackend, float32_dots
    from harness.verdict.tolerance import matmul_precision, rel_tolerance
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    native = SGLangTritonBackend.__new__(SGLangTritonBackend)
    native.interpret = False
    assert matmul_precision("float32", native) == "tf32"      # Triton's own default on CUDA
    assert float32_dots(tf32=False) == "ieee"
    assert matmul_precision("float32", native) == "float32" and rel_tolerance("float32") == 1e-4
    assert float32_dots(tf32=True) == "tf32" and matmul_precision("float32", native) == "tf32"
    with pytest.raises(UsageError, match="--tf32"):
        RunSettings(dtype="bfloat16", tf32=True)
