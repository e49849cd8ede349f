"""DeepSeek-V3's layout end to end (issue 24), engine against oracle on the
CPU: tiny-deepseek-v3 passes at budget 16, topk 1; padded-kv-visible and the
three MLA/MoE faults are caught and named; a bf16 run shows its router flips
inside the noise as router ties and passes. Skipped where the registered
oracle cannot read the layout (it has no path_latent)."""
from __future__ import annotations

import pytest

from harness.check.differential import check
from harness.check.oracle_lookup import load_oracle_class
from harness.check.prepare import prepare
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings
from harness.faults.registry import catalog

pytestmark = pytest.mark.skipif(not hasattr(load_oracle_class(), "path_latent"),
                                reason="the registered oracle does not read DeepSeek-V3's layout")
MODEL = "tiny-deepseek-v3"


def run_check(**kw):
    s = RunSettings(model=MODEL, backend="torch", budget=16, max_new_tokens=12, **kw)
    return check(prepare(s), RecordWriter(None))


def test_tiny_deepseek_v3_passes_at_budget_16_topk_1():
    summary = run_check(topk=1)
    assert summary.passed and summary.divergent_nodes == 0 and summary.nodes_checked > 0
    assert summary.max_rel_err < 1e-5


@pytest.mark.parametrize("fault,topk", [("padded-kv-visible", 1), ("mla-latent-wrong-slot", 1),
                                        ("moe-router-reads-padding", 1), ("mla-rope-flat-index", 2)])
def test_each_fault_is_caught_and_named(fault, topk):
    summary = run_check(topk=topk, fault=fault)
    assert not summary.passed and summary.fault_class == catalog()[fault].expected_class


def test_a_bf16_run_names_its_router_flips_as_router_ties():
    summary = check(prepare(RunSettings(model=MODEL, backend="torch", budget=16, topk=2, batch=2,
                                        dtype="bfloat16")), RecordWriter(None))
    assert summary.passed and summary.router_ties > 0
