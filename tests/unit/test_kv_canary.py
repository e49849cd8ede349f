"""KV provenance canary (harness/engine/mem/provenance.py): every slot read or
written by a verify is checked against the (request, position, token) last
written there; free slots hold NaN. The poison never changes a fault-free
run's logits, and a read of a freed slot is caught and named."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from harness.check.differential import check

from harness.check.prepare import prepare
from harness.engine.mem.provenance import BATCH_PADDING, FREE, SlotProvenance
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings

BASE = RunSettings(backend="torch", max_new_tokens=10)
CLEAN_SLICE = ({}, {"topk": 2}, {"cuda_graph": True, "batch": 3}, {"cuda_graph": True, "topk": 2, "batch": 2})


def _rounds(s: RunSettings):
    engine = prepare(s).engine
    out = []
    for result in engine.rounds():   # with the graph's every row, batch-padding dummies included
        out.append((result, engine.graph.last.logits.clone() if engine.graph is not None else None))
    return engine, out


def _backends():
    out = ["torch"]
    from harness.engine.attn.sglang_triton import available
    if available():
        out.append(pytest.param("sglang-triton", marks=pytest.mark.sglang))
    return out


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("extra", CLEAN_SLICE)
def test_poisoned_free_slots_never_change_a_fault_free_run(extra, backend):
    s = replace(BASE, backend=backend, **extra)
    poisoned_engine, poisoned = _rounds(replace(s, kv_poison=True))
    _, plain = _rounds(replace(s, kv_poison=False))
    assert len(poisoned) == len(plain) > 1
    for (a, ga), (b, gb) in zip(poisoned, plain):
        assert ga is None or torch.equal(ga, gb), f"step {a.step}: the poison reached a graph row"
        assert not a.provenance and not b.provenance, a.provenance or b.provenance
        for ra, rb in zip(a.requests, b.requests):
            assert torch.equal(ra.logits, rb.logits), f"step {a.step} request {ra.rid}: the poison reached the logits"
    free = torch.tensor(sorted(set(range(1, poisoned_engine.pool.allocator.num_slots))
                               - poisoned_engine.pool.allocator.owned))
    assert torch.isnan(poisoned_engine.pool.v_buffer[0][free]).all()   # the poison was there to be read
    assert not poisoned_engine.finish_findings


def test_a_read_of_a_freed_slot_is_caught_with_and_without_poison():
    s = replace(BASE, fault="free-slot-read")
    w = RecordWriter(None)
    summary = check(prepare(s), w)
    assert summary.fault_class == "free-slot-read" and summary.divergent_nodes > 0   # NaN through the logits
    found = [json.loads(x) for x in w.lines if '"kind": "provenance"' in x]
    assert found and found[0]["finding"] == "free-slot" and found[0]["step"] == 1
    quiet = check(prepare(replace(s, kv_poison=False)), RecordWriter(None))
    assert quiet.divergent_nodes == 0                  # the freed slot still holds the right K/V ...
    assert not quiet.passed and quiet.provenance_findings and quiet.fault_class == "free-slot-read"  # ... but it is free


def _prov() -> SlotProvenance:
    p = SlotProvenance(10)
    p.stamp(torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2]), torch.tensor([7, 8, 9]))
    p.stamp(torch.tensor([4, 5]), torch.tensor([1, BATCH_PADDING]), torch.tensor([0, 0]), torch.tensor([7, 0]))
    return p


@pytest.mark.parametrize("slots,kind", [([1, 2, 3], None), ([1, 4, 3], "other-request"), ([1, 3, 2], "position"),
                                        ([1, 2, 6], "free-slot"), ([1, 5, 3], "batch-padding")])
def test_reads_are_judged_by_owner_position_and_token(slots, kind):
    found = _prov().check_reads(0, 0, torch.tensor(slots), [7, 8, 9])
    assert [f.kind for f in found] == ([kind] if kind else [])
    assert _prov().check_reads(0, 0, torch.tensor([1, 2, 3]), [7, 8, 1])[0].kind == "token"


def test_writes_into_committed_or_free_slots_are_findings_and_moves_carry_provenance():
    p = _prov()
    committed = {1: (0, 0), 2: (0, 1)}
    rows = dict(owners=torch.tensor([0, 0]), positions=torch.tensor([3, 3]), allocated=frozenset({6, 7}),
                committed=committed)
    assert p.check_writes(0, torch.tensor([6, 7]), **rows) == []
    assert p.check_writes(0, torch.tensor([6, 2]), **rows)[0].kind == "clobber"
    assert p.check_writes(0, torch.tensor([8, 7]), **rows)[0].kind == "write-free"
    p.move(torch.tensor([8]), torch.tensor([3]))
    p.freed(torch.tensor([3]))
    assert p.check_reads(0, 0, torch.tensor([1, 2, 8]), [7, 8, 9]) == []
    assert int(p.owner[3]) == FREE


def test_a_batch_padding_row_writing_a_live_rows_slot_is_a_finding():
    p = _prov()
    rows = dict(allocated=frozenset({6, 7}), committed={})
    owners = torch.tensor([0, 0, BATCH_PADDING, BATCH_PADDING])
    assert p.check_writes(0, torch.tensor([6, 7, 0, 0]), owners, torch.tensor([3, 4, 0, 0]), **rows) == []
    found = p.check_writes(0, torch.tensor([6, 7, 0, 7]), owners, torch.tensor([3, 4, 0, 4]), **rows)
    assert [(f.kind, f.slot, f.request) for f in found] == [("padding-write", 7, 0)]


@pytest.mark.parametrize("poison", [True, False])
def test_live_padding_entries_are_caught_and_named_with_and_without_poison(poison):
    s = replace(BASE, fault="padded-entry-live", cuda_graph=True, batch=3, kv_poison=poison)
    w = RecordWriter(None)
    summary = check(prepare(s), w)
    assert not summary.passed and summary.fault_class == "padded-entry-live"
    assert summary.divergent_nodes > 0                 # the dummy's K/V reach request 2's later rounds
    found = [json.loads(x) for x in w.lines if '"kind": "provenance"' in x]
    assert found[0]["finding"] == "padding-write" and found[0]["step"] == 0 and found[0]["request"] == 2
    assert "batch-padding entries" in summary.explanation


def test_run_prints_a_provenance_first_divergence(tmp_path):
    """A run whose first divergence is a canary finding (no logits differ) prints it, exit 1."""
    from typer.testing import CliRunner
    from harness.cli import _register, app
    _register()
    out = CliRunner().invoke(app, ["run", "--backend", "torch", "--fault", "free-slot-read", "--no-kv-poison",
                                   "--max-new-tokens", "10", "--out", str(tmp_path / "r.jsonl")],
                             env={"COLUMNS": "400"})
    assert out.exit_code == 1, out.output
    assert "KV provenance: step 1" in out.output and "is free" in out.output
