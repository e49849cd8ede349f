"""Same verdicts on SGLang's own kernel: the fault-free matrix (budget
{4, 8, 16, 32} x topk {1, 2, 4} x graph {on, off} x batch {1, 4}) passes with
--backend sglang-triton (the Triton interpreter on CPU), and
padded-kv-visible is caught there.

The interpreter is slow, so CI runs a slice: every budget with every topk
once, every (graph, batch) pair, the seed's setting (budget 16, topk 1,
eager, batch 1) and a batch-4 graph one. Measured on 2 cores, one torch
thread, max_new_tokens 12: 0.4-1.4 s a batch-1 setting, 3-9 s a batch-4
one; the slice about 45 s, the whole matrix about 155 s. DDCHECK_FULL=1 runs
the whole matrix (marked slow)."""
from __future__ import annotations

import itertools
import os

import pytest

from harness.check.differential import check

from harness.check.prepare import prepare
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings

pytestmark = pytest.mark.sglang

MAX_NEW_TOKENS = 12  # three verify rounds per request at least
FAULT = "padded-kv-visible"
MATRIX = [dict(budget=b, topk=k, cuda_graph=g, batch=bs)
          for b, k, g, bs in itertools.product((4, 8, 16, 32), (1, 2, 4), (True, False), (1, 4))]
# (budget, topk, graph, batch): each budget x topk once, each (graph, batch) pair at least twice
CI_SLICE = [dict(budget=b, topk=k, cuda_graph=g, batch=bs) for b, k, g, bs in (
    (4, 1, False, 1), (4, 2, True, 4), (4, 4, False, 4),
    (8, 1, True, 1), (8, 2, False, 1), (8, 4, True, 4),
    (16, 1, False, 1), (16, 1, True, 4), (16, 2, True, 1), (16, 4, False, 4),
    (32, 1, False, 4), (32, 2, True, 4), (32, 4, True, 1))]
FULL = os.environ.get("DDCHECK_FULL") == "1"


def setting_id(m: dict) -> str:
    return f"b{m['budget']}-k{m['topk']}-{'graph' if m['cuda_graph'] else 'eager'}-bs{m['batch']}"


def run_check(fault: str | None = None, **m):
    s = RunSettings(**m, backend="sglang-triton", max_new_tokens=MAX_NEW_TOKENS, fault=fault)
    return check(prepare(s), RecordWriter(None), localize=False)  # localization has its own tests


def test_ci_slice_covers_every_axis_value():
    for key, values in (("budget", {4, 8, 16, 32}), ("topk", {1, 2, 4})):
        assert {m[key] for m in CI_SLICE} == values
    assert {(m["budget"], m["topk"]) for m in CI_SLICE} == set(itertools.product((4, 8, 16, 32), (1, 2, 4)))
    assert {(m["cuda_graph"], m["batch"]) for m in CI_SLICE} == set(itertools.product((True, False), (1, 4)))
    assert dict(budget=16, topk=1, cuda_graph=False, batch=1) in CI_SLICE
    assert all(m in MATRIX for m in CI_SLICE)


@pytest.mark.parametrize("m", CI_SLICE, ids=setting_id)
def test_fault_free_setting_passes_on_sglang_kernel(m):
    summary = run_check(**m)
    assert summary.passed, (summary.first, summary.notes)
    assert summary.nodes_checked > 0 and summary.max_rel_err < 1e-5  # kernel vs float64, float32 run
    assert summary.accept_mismatches == 0 and not any("skipped" in n for n in summary.notes)


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="the whole matrix under the interpreter: set DDCHECK_FULL=1")
@pytest.mark.parametrize("m", [m for m in MATRIX if m not in CI_SLICE], ids=setting_id)
def test_fault_free_setting_passes_on_sglang_kernel_full(m):
    summary = run_check(**m)
    assert summary.passed, (summary.first, summary.notes)
    assert summary.accept_mismatches == 0


@pytest.mark.parametrize("m", [dict(budget=16, topk=1, cuda_graph=False, batch=1),
                               dict(budget=32, topk=1, cuda_graph=True, batch=4)], ids=setting_id)
def test_padded_kv_visible_is_caught_on_sglang_kernel(m):
    summary = run_check(fault=FAULT, **m)
    assert not summary.passed and summary.divergent_nodes > 0
    f = summary.first
    assert f.what == "node" and f.depth is not None and f.padding_present  # a real node, named
    assert f.rel_err > 1e-2
