"""The noise-floor verdict: each bf16 node judged against its correct
low-precision twin, not a fixed table."""
from __future__ import annotations

import json

import math
from dataclasses import replace

import pytest
import torch

from harness.check.differential import check

from harness.check.causal_twin import CausalTwin
from harness.check.prepare import prepare
from harness.check.compare.metrics import compare_node
from harness.verdict.noise_floor import (ALARMS_PER_RUN, NOISE, NoiseFloorRule, NoiseTail, planned_nodes,
                                         verdict_rule)
from harness.faults.one_key import ONE_KEY_LEAKS
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings, UsageError


def run(leak=None, every_twin=False, **kw):
    s = RunSettings(**{"backend": "torch", "max_new_tokens": 10, "stop_after": 0, **kw})
    p = replace(prepare(s), every_twin=every_twin)
    if leak:
        p.engine.pipeline = replace(p.engine.pipeline, build_mask=ONE_KEY_LEAKS[leak])
    w = RecordWriter(None)
    return check(p, w, localize=False), w


def judged_nodes(w) -> list[dict]:
    return [r for r in map(json.loads, w.lines) if r.get("kind") == "node" and not r["is_padding"]]


def test_rule_bound_and_ratio():
    r = NoiseFloorRule(multiplier=2.0, floor=0.01, ceiling=0.2, drift_limit=1.5)
    assert r.bound(0.03, 0.02) == pytest.approx(0.06) and r.bound(0.001, 0.002) == pytest.approx(0.02)
    assert r.bound(0.02, 0.04) == pytest.approx(0.08)          # the larger yardstick sets the scale
    assert r.bound(0.5, 0.1) == 0.2 and r.ratio(0.06, 0.03, 0.01) == pytest.approx(2.0)
    assert r.drift([(0.02, 0.01), (0.03, 0.01), (0.01, 0.01)]) == pytest.approx(2.0)   # the median node
    with pytest.raises(ValueError):
        NoiseFloorRule(multiplier=0.5, floor=0.01, ceiling=0.2, drift_limit=1.5)


def test_the_multiplier_is_set_by_the_node_count_and_the_per_run_budget():
    """A correct run of N nodes false-alarms with probability ALARMS_PER_RUN:
    each node's tail probability above the multiplier is ALARMS_PER_RUN / N."""
    tail = NoiseTail(mu=-0.1, sigma=0.2)
    from statistics import NormalDist
    for n in (10, 1000, 100000):
        m = tail.multiplier(n)
        per_node = 1.0 - NormalDist(-0.1, 0.2).cdf(math.log(m))
        assert per_node * n == pytest.approx(ALARMS_PER_RUN, rel=1e-6)
    assert tail.multiplier(10) < tail.multiplier(1000) < tail.multiplier(100000)
    assert tail.multiplier(1000, alarms_per_run=1e-2) < tail.multiplier(1000)
    s = RunSettings(dtype="bfloat16", max_new_tokens=10, batch=2, budget=8)
    assert planned_nodes(s) == 10 * 2 * 9
    assert verdict_rule("bfloat16", "auto", False, nodes=180).multiplier == pytest.approx(
        NOISE["bfloat16"].tail.multiplier(180))


def test_which_runs_it_judges():
    assert verdict_rule("bfloat16", "auto", False) == NOISE["bfloat16"].rule(1)
    assert verdict_rule("bfloat16", "auto", True) is None          # an explicit tolerance is a fixed verdict
    assert verdict_rule("float32", "auto", False) is None
    assert verdict_rule("float16", "fixed", False) is None
    calibrated = verdict_rule("bfloat16", "auto", False, (1.7, 0.004, 0.2))
    assert calibrated.drift_limit == NOISE["bfloat16"].drift_limit
    assert calibrated.excess_ratio == NOISE["bfloat16"].excess_ratio   # test 3 stays on a calibrated rule
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
    assert summary.max_noise_ratio < summary.noise_rule["multiplier"]
    assert summary.noise_drift < summary.noise_rule["drift_limit"]
    assert summary.noise_excess["nodes"] == summary.nodes_checked and summary.noise_excess["p"] > 1e-5
    nodes = judged_nodes(w)
    assert nodes and all(r["rounded_err"] is not None and r["noise_ratio"] is not None for r in nodes)
    rule = NoiseFloorRule(**{k: summary.noise_rule[k] for k in ("multiplier", "floor", "ceiling", "drift_limit",
                                                                 "excess_ratio")})
    # the twin computed exactly where it can change a verdict, and counted
    assert [r["twin_err"] is not None for r in nodes] == [rule.needs_twin(r["rel_err"], r["rounded_err"]) for r in nodes]
    assert summary.twin_nodes == sum(r["twin_err"] is not None for r in nodes)


def test_a_steps_twins_are_one_call_for_every_request_that_needs_one(monkeypatch):
    """The check asks the twin once per step, for every request with a node whose verdict it can change
    (CausalTwin.step_logits: one forward), not once per request."""
    calls: list[int] = []   # requests asked, per call
    step_logits = CausalTwin.step_logits
    monkeypatch.setattr(CausalTwin, "step_logits", lambda self, asks: calls.append(len(asks)) or step_logits(self, asks))
    summary, w = run(dtype="bfloat16", topk=2, batch=4, noise_rule=(1.0, 1e-6, 0.9))   # most nodes need one
    asked: dict[int, set[int]] = {}   # step -> requests with a twin
    for r in judged_nodes(w):
        if r["twin_err"] is not None:
            asked.setdefault(r["step"], set()).add(r["request"])
    assert calls == [len(asked[s]) for s in sorted(asked)]
    assert sum(calls) > len(calls)   # some step asked for both requests' twins at once


def test_rule_needs_the_twin_only_where_it_can_change_a_verdict():
    r = NoiseFloorRule(multiplier=2.0, floor=0.01, ceiling=0.2, drift_limit=1.5, excess_ratio=1.5)
    assert not r.needs_twin(0.014, 0.01)          # inside 1.5 x the rounded scale: no test changes
    assert r.needs_twin(0.016, 0.01)              # test 3 counts it without the twin: a twin may clear it
    assert r.needs_twin(0.03, 0.01)               # past bound(0, 0.01) = 0.02: the twin may raise the bound
    assert r.needs_twin(0.3, 0.01)                # past the ceiling: diverges whatever the twin, but test 3's count
    assert not r.needs_twin(float("inf"), 0.01)   # non-finite: diverges, ratio inf, whatever the twin
    no3 = NoiseFloorRule(multiplier=2.0, floor=0.01, ceiling=0.2, drift_limit=1.5)
    assert not no3.needs_twin(0.016, 0.01) and no3.needs_twin(0.021, 0.01) and not no3.needs_twin(0.3, 0.01)
    for e in (0.001, 0.012, 0.016, 0.03, 0.19, 0.5):   # no twin error changes the verdicts of a node said not to need it
        for twin in (0.0, 0.004, 0.02, 0.3):
            if not r.needs_twin(e, 0.01):
                assert (e > r.bound(twin, 0.01)) == (e > r.bound(0.0, 0.01))
                assert (r.ratio(e, twin, 0.01) > 1.5) == (r.ratio(e, 0.0, 0.01) > 1.5)


@pytest.mark.parametrize("leak", [None, "one-sibling-visible"])
def test_twins_where_needed_give_the_verdicts_of_every_twin(leak):
    """The check with the twin of every node and with the twins only where they can change a verdict: the same
    verdict, the same divergent nodes, the same drift; fewer twins computed."""
    lazy, wl = run(leak, dtype="bfloat16", topk=4, max_new_tokens=6)
    full, wf = run(leak, every_twin=True, dtype="bfloat16", topk=4, max_new_tokens=6)
    assert (lazy.passed, lazy.divergent_nodes, lazy.noise_drift) == (full.passed, full.divergent_nodes, full.noise_drift)
    assert [r["verdict"] for r in judged_nodes(wl)] == [r["verdict"] for r in judged_nodes(wf)]
    assert lazy.noise_excess == full.noise_excess
    assert full.twin_nodes == full.nodes_checked and (lazy.twin_nodes or 0) < full.twin_nodes
    if leak:
        assert lazy.divergent_nodes > 0


@pytest.mark.parametrize("leak", ["one-sibling-visible", "one-ancestor-hidden"])
def test_a_one_key_leak_fails_a_bf16_run(leak):
    noise, _ = run(leak, dtype="bfloat16", topk=4, max_new_tokens=6)
    assert noise.divergent_nodes > 0 and noise.max_noise_ratio > noise.noise_rule["multiplier"]


def _rope_angles_in_bf16(self, positions, inv_freq):
    """benchmarks/mutations/26-rope-angles-bf16.patch: the angles rounded to bf16 before cos/sin."""
    freqs = (positions.to(torch.float64)[:, None] * inv_freq[None]).to(torch.bfloat16).double()
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(self.dtype)[:, None], emb.sin().to(self.dtype)[:, None]


def test_a_model_arithmetic_bug_shared_with_the_twin_fails_a_bf16_run(monkeypatch):
    """RoPE angles in bf16 sit in the engine's model code, which the causal
    twin shares (ratio 1.00): the oracle's own rounded computation does not
    share it, and the run's drift shows it."""
    from harness.engine.model.llama import LlamaModel
    clean, _ = run(dtype="bfloat16", prompt_lens=(200,), max_new_tokens=6)
    monkeypatch.setattr(LlamaModel, "_rope", _rope_angles_in_bf16)
    bad, _ = run(dtype="bfloat16", prompt_lens=(200,), max_new_tokens=6)
    assert clean.passed and clean.noise_drift < clean.noise_rule["drift_limit"]
    assert not bad.passed and bad.first.what == "drift"
    assert bad.noise_drift > bad.noise_rule["drift_limit"] and bad.max_noise_ratio < bad.noise_rule["multiplier"]


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


def test_a_softmax_scale_three_percent_off_in_the_kernel_fails_a_bf16_run(monkeypatch):
    """benchmarks/mutations/33-sglang-sm-scale.patch's kind of bug, 3% off,
    inside the kernel the twin reuses: the twin agrees with the engine, the
    oracle's own rounded computation does not."""
    from harness.engine.attn.torch_backend import TorchBackend
    kernel = TorchBackend.forward

    def scaled(self, q, *args, **kwargs):
        return kernel(self, q * 1.03, *args, **kwargs)   # sm_scale 1.03 / sqrt(d)
    monkeypatch.setattr(TorchBackend, "forward", scaled)
    bad, _ = run(dtype="bfloat16", prompt_lens=(200,), max_new_tokens=6)
    assert not bad.passed and bad.first.what == "drift" and bad.max_noise_ratio < bad.noise_rule["multiplier"]


def test_binomial_upper_tail():
    from harness.verdict.noise_floor import binomial_upper_tail
    assert binomial_upper_tail(10, 0, 0.01) == 1.0 and binomial_upper_tail(3, 4, 0.01) == 0.0
    assert binomial_upper_tail(1, 1, 0.01) == pytest.approx(0.01)
    assert binomial_upper_tail(2, 1, 0.5) == pytest.approx(0.75)
    exact = sum(math.comb(300, i) * 0.01 ** i * 0.99 ** (300 - i) for i in range(8, 301))
    assert binomial_upper_tail(300, 8, 0.01) == pytest.approx(exact, rel=1e-9)


def test_the_excess_test_fails_a_run_whose_small_errors_repeat():
    """Test 3: every node within its own bound (ratio below the multiplier),
    but far more of them in the tail than correct nodes put there."""
    from types import SimpleNamespace
    from harness.check.differential import _check_excess
    from harness.check.summary import CheckSummary
    rule = NOISE["bfloat16"].rule(400)
    assert rule.excess_ratio is not None and rule.excess_ratio < 1.9 < rule.multiplier
    p = SimpleNamespace(rule=rule, settings=SimpleNamespace(dtype="bfloat16"))
    quiet = [(1.0, s, 0, n) for s in range(40) for n in range(10)]
    repeated = [(1.9 if n == 9 else 1.0, s, 0, n) for s in range(40) for n in range(10)]   # the last row, every step
    ok, bad = CheckSummary("s"), CheckSummary("s")
    _check_excess(p, ok, quiet)
    _check_excess(p, bad, repeated)
    assert ok.checks_passed and ok.noise_excess == dict(above=0, nodes=400, p=1.0)
    assert not bad.checks_passed and bad.noise_excess["above"] == 40 and bad.first.what == "excess"
    assert (bad.first.step, bad.first.node) == (39, 9) and "40 of 400 nodes" in bad.first.detail
    few = [(1.9 if (n == 9 and s < 3) else 1.0, s, 0, n) for s in range(40) for n in range(10)]
    _check_excess(p, few_s := CheckSummary("s"), few)
    assert few_s.checks_passed    # 3 of 400 in the 1% tail is what correct runs do
