"""The localizer reuses the run's weights, oracle and pipeline: a custom
stage set on the run (not a catalog fault, not in the settings) is what it
re-runs and probes, and nothing is loaded a second time."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

import harness.check.prepare as prepare_module
from harness.check.differential import check
from harness.check.prepare import derive, prepare
from harness.faults.one_key import ONE_KEY_LEAKS
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings


def test_a_custom_mask_stage_is_localized_without_reloading(monkeypatch):
    p = prepare(RunSettings(backend="torch", max_new_tokens=8))
    p.engine.pipeline = replace(p.engine.pipeline, build_mask=ONE_KEY_LEAKS["last-row-sees-one-padding"])

    def no_second_load(*a, **k):
        raise AssertionError("the localizer loaded the checkpoint again")
    monkeypatch.setattr(prepare_module, "load_checkpoint", no_second_load)
    monkeypatch.setattr(prepare_module, "load_oracle_from", no_second_load)
    w = RecordWriter(None)
    summary = check(p, w)
    assert not summary.passed
    loc = next(r for r in map(json.loads, w.lines) if r.get("kind") == "localize")
    assert loc["mask_probe"], "the probe ran on the run's own (custom) mask stage"
    assert summary.fault_class == "padding-leak", summary.explanation


def test_derive_shares_the_weights_and_refuses_another_model():
    p = prepare(RunSettings(backend="torch", max_new_tokens=4))
    q = derive(p, replace(p.settings, budget=8, topk=2))
    assert q.oracle is p.oracle and q.engine.model.w["model.embed_tokens.weight"] is p.engine.model.w[
        "model.embed_tokens.weight"]
    assert q.engine.q_len == 9
    with pytest.raises(ValueError, match="keeps the model"):
        derive(p, replace(p.settings, seed=3))


def test_a_localizer_out_of_memory_is_one_note_and_the_verdict_stands(monkeypatch):
    import harness.check.localize as localize_pkg
    p = prepare(RunSettings(backend="torch", max_new_tokens=6, fault="padded-kv-visible"))

    def oom(*a, **k):
        raise MemoryError()
    monkeypatch.setattr(localize_pkg, "localize", oom)
    summary = check(p, RecordWriter(None))
    assert not summary.passed and summary.divergent_nodes > 0
    assert any(n.startswith("localizer: not enough host memory") for n in summary.notes)
