"""Explanations from evidence (issue 9, item 1): the mask probe's diff by
role, the KV audit in the text, the first wrong quantity and its stage
before any class, "unknown" when nothing measured points anywhere."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from harness.engine.attn import make_backend
from harness.check.differential import check
from harness.check.prepare import prepare
from harness.engine.ddtree.mask import flat_custom_mask, flatten_blocks, request_mask_block
from harness.engine.ddtree.tree import DraftTree
from harness.engine.ddtree.verify_inputs import build_verify_batch
from harness.faults.registry import catalog
from harness.faults.one_key import ONE_KEY_LEAKS
from harness.check.localize.audits import Finding
from harness.check.localize.explain import CATALOG_CLASSES, Evidence, classify, explanation
from harness.check.localize.kv_audit import KVAudit, Violation
from harness.check.localize.mask_probe import diff_request, pair_role, probe_visibility
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings

# root; rows 1, 2 under the root; row 3 under row 1; row 4 under row 2; 2 padding rows
TREE = DraftTree((5, 6, 7, 8, 9), (None, 0, 0, 1, 2), (0, 1, 1, 2, 2), q_len=7)
PREFIX = 3


def probe(builder, tree=TREE, prefix=PREFIX):
    req_to_token = torch.arange(1, 21).view(1, 20)
    loc = torch.arange(200, 200 + tree.q_len)
    vb = build_verify_batch([tree], [prefix], [0], req_to_token, loc, builder)
    (vis,) = probe_visibility(make_backend("torch", "cpu", torch.float32), vb.attn, 2, 1, 4)
    return diff_request(0, vis, tree, req_to_token[0, :prefix].tolist() + loc.tolist(), frozenset({"prefix", "draft"}))


def test_every_key_has_its_role_for_every_row():
    d = probe(flat_custom_mask)
    assert d.clean
    roles = [pair_role(d, 3, c) for c in range(PREFIX + TREE.q_len)]
    assert roles == ["prefix"] * 3 + ["ancestor", "ancestor", "other branch", "itself", "other branch",
                                      "padding", "padding"]
    assert [pair_role(d, 1, PREFIX + k) for k in (3, 2, 4)] == ["descendant", "sibling", "other branch"]
    assert pair_role(replace(d, other_request_cols=(0,)), 3, 0) == "other request"


@pytest.mark.parametrize("leak, row, change, role, key", [
    ("one-sibling-visible", 2, "gained", "sibling", 1),
    ("one-ancestor-hidden", 4, "lost", "ancestor", 2),
])
def test_a_one_key_mask_bug_is_named_by_row_key_and_role(leak, row, change, role, key):
    d = probe(ONE_KEY_LEAKS[leak])
    pairs = d.leaked if change == "gained" else d.blocked
    assert len(d.leaked) + len(d.blocked) == 1
    r, c = pairs[0]
    assert (r, c - PREFIX) == (row, key)
    cause = classify(Evidence("x", "node", 0, TREE.num_rows, probes=[d], node=r))
    assert cause.cls == "mask-visibility" and cause.stage == "mask"
    assert f"row {r} {change} {role} key {c - PREFIX} (slot {200 + c - PREFIX})" in cause.text
    assert "shift" not in cause.text


def test_a_mask_moved_along_the_buffer_is_still_a_shift():
    def moved(trees, prefix_lens):
        mask, indptr = flatten_blocks([request_mask_block(t, p) for t, p in zip(trees, prefix_lens)])
        return torch.roll(mask, 1), indptr
    d = probe(moved)
    cause = classify(Evidence("x", "node", 0, TREE.num_rows, probes=[d]))
    assert cause.cls == "mask-shift" and "moved by 1 elements" in cause.text and "gained" in cause.text


def localized(settings: RunSettings, **stages):
    p = prepare(settings)
    if stages:
        p.engine.pipeline = replace(p.engine.pipeline, **stages)
    w = RecordWriter(None)
    summary = check(p, w)
    loc = next((r for r in map(json.loads, w.lines) if r.get("kind") == "localize"), None)
    return summary, loc


@pytest.mark.parametrize("leak, role, extra", [("one-sibling-visible", "sibling", {"topk": 4}),
                                               ("one-ancestor-hidden", "ancestor", {})])
def test_a_mask_bug_outside_the_catalog_names_row_key_and_role(leak, role, extra):
    s = RunSettings(backend="torch", dtype="float32", max_new_tokens=6, stop_after=0, **extra)
    summary, loc = localized(s, build_mask=ONE_KEY_LEAKS[leak])
    assert not summary.passed
    changes = loc["mask_probe"]["changes"]
    assert len(changes) == 1 and changes[0]["role"] == role
    row, key = changes[0]["row"], changes[0]["col"] - loc["mask_probe"]["prefix_len"]
    change = "gained" if leak == "one-sibling-visible" else "lost"
    assert summary.fault_class == "mask-visibility", summary.explanation
    assert summary.explanation.startswith("First wrong quantity: custom_mask, produced "
                                          "by the mask stage")
    assert f"row {row} {change} {role} key {key} (slot " in summary.explanation
    assert "mask-shift" not in summary.explanation and "shifted" not in summary.explanation
    assert "Catalog class" not in summary.explanation


def _last_prefix_reads_the_first(trees, seq_lens, req_pool_indices, req_to_token, out_cache_loc, mask_builder):
    """Eager kv_indices with each prefix's last position reading its first position's slot."""
    vb = build_verify_batch(trees, seq_lens, req_pool_indices, req_to_token, out_cache_loc, mask_builder)
    idx, kvp = vb.attn.kv_indices.clone(), vb.attn.kv_indptr.tolist()
    for b in range(len(trees)):
        idx[kvp[b + 1] - 1] = idx[kvp[b]]
    return replace(vb, attn=replace(vb.attn, kv_indices=idx))


def test_a_kv_indices_violation_is_the_explanation():
    s = RunSettings(backend="torch", dtype="float32", max_new_tokens=4, stop_after=0)
    summary, loc = localized(s, build_verify_batch=_last_prefix_reads_the_first)
    assert not summary.passed and summary.fault_class == "kv-indices", summary.explanation
    assert summary.explanation.startswith("First wrong quantity: kv_indices, produced by the verify inputs stage")
    assert "the kernel's kv_indices differ from req_to_token" in summary.explanation
    assert "kv_indices" in loc["kv_audit"]["violation_kinds"]


def test_a_slot_referenced_after_its_free_reaches_the_explanation():
    from harness.workflows.fault_selftest import base_settings, fault_settings
    summary, loc = localized(fault_settings("free-slot-read", base_settings("torch", quick=True)))
    assert summary.fault_class == "free-slot-read"
    assert "referenced-free" in loc["kv_audit"]["violation_kinds"]
    assert "which the allocator holds free" in summary.explanation
    assert summary.explanation.startswith("First wrong quantity: ") and "stage" in summary.explanation
    assert summary.explanation.endswith("Catalog class: free-slot-read.")


def test_kv_audit_findings_are_in_the_text_even_behind_another_cause():
    kv = KVAudit([Violation(2, "kv_indices", "request 0: the kernel's kv_indices differ from req_to_token[:9]"),
                  Violation(3, "kv_indices", "request 1: again")], first_bad_step=2, first_bad_request=0,
                 first_bad_position=7, first_bad_layer=0, first_bad_slot=41, held_position=3)
    ev = Evidence("step 2, request 0, node 0 (depth 0)", "node", 0, 1, kv=kv,
                  inputs=Finding("positions", "positions are not prefix + depth: rows 1 (depth 1) at 9 not 8"))
    text = explanation(ev, classify(ev))
    assert text.startswith("First wrong quantity: positions, produced by the verify inputs stage")
    assert "step 2: request 0: the kernel's kv_indices differ" in text and "again" not in text  # first of each kind
    assert "position 7 (slot 41), layer 0, holds position 3's K/V" in text


def test_nothing_measured_is_unknown_not_a_class():
    ev = Evidence("step 0, request 0, node 1 (depth 1)", "node", 0, 2)
    cause = classify(ev)
    assert cause.cls == "unknown" and cause.stage is None
    text = explanation(ev, cause)
    assert text.startswith("First wrong quantity: unknown at step 0") and "Catalog class" not in text


def test_catalog_classes_are_the_catalogs():
    assert set(CATALOG_CLASSES) == {f.expected_class for f in catalog().values()}   # every registered fault
