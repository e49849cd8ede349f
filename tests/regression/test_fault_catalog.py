"""CI slice of `ddcheck faults --check`: every fault once on the torch
backend (short runs) is detected and named by the localizer; padded-kv-visible
is localized on SGLang's kernel too; a fault-free run stays quiet."""
from __future__ import annotations

from dataclasses import replace

import pytest

from harness.check.differential import check

from harness.check.prepare import prepare
from harness.faults.registry import catalog
from harness.faults.tp_faults import TP_FAULTS
from harness.workflows.fault_selftest import base_settings, fault_settings, run_one
from harness.check.records import RecordWriter

BASE = base_settings("torch", quick=True)


# the TP-only faults spawn ranks: tests/unit/test_tp_cli.py and test_tp_audit.py hold them (benchmarks/tp_matrix.py
# runs each end to end)
@pytest.mark.parametrize("name", sorted(n for n in catalog() if n not in {f.name for f in TP_FAULTS}))
def test_fault_is_detected_and_named(name):
    row = run_one(fault_settings(name, BASE), catalog()[name].expected_class)
    assert row.detected, f"{name} was not detected under {row.settings.command()}"
    assert row.fault_class == row.expected_class


def test_fault_free_runs_raise_no_alarm():
    for extra in ({"topk": 2}, {"cuda_graph": True, "batch": 3}):
        row = run_one(replace(BASE, seed=1, **extra), None)
        assert not row.detected and row.fault_class is None


@pytest.mark.sglang
def test_padded_kv_visible_is_localized_on_sglangs_kernel():
    from harness.engine.attn.sglang_triton import available
    if not available():
        pytest.skip("SGLang's kernel does not import")
    s = replace(fault_settings("padded-kv-visible", BASE), backend="sglang-triton", max_new_tokens=3)
    writer = RecordWriter(None)
    summary = check(prepare(s), writer)
    assert not summary.passed and summary.fault_class == "padding-leak"
    import json
    loc = next(json.loads(line) for line in writer.lines if '"kind": "localize"' in line)
    probe = loc["mask_probe"]
    assert probe["ignored_regions"] == ["prefix"]               # the kernel skips the prefix columns
    assert probe["leaked"] and not probe["blocked"]
    assert all(probe["key_roles"][c].startswith("padding:") for _, c in probe["leaked"])
    assert "padding rows (KV slots" in summary.explanation and "first wrong at layer" in summary.explanation
