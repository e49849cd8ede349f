"""The localizer's pieces: the black-box mask probe on both backends, the
diff against the tree, the layout hypotheses, the audits, the rules."""
from __future__ import annotations

import pytest
import torch

from harness.engine.attn import make_backend
from harness.faults import catalog as faults
from harness.check.localize.audits import audit_inputs
from harness.check.localize.explain import Evidence, classify
from harness.check.localize.mask_probe import (ancestor_mask, derived_parents, diff_request, probe_visibility,
                                         row_stride_explains)
from harness.engine.ddtree.mask import flat_custom_mask
from harness.engine.ddtree.tree import DraftTree
from harness.engine.ddtree.verify_inputs import build_verify_batch

# root, 3 nodes (row 3 is row 1's child), 2 padding rows; a chain of 2 nodes, 3 padding rows
TREES = [DraftTree((5, 6, 7, 8), (None, 0, 0, 1), (0, 1, 1, 2), q_len=6),
         DraftTree((9, 10, 11), (None, 0, 1), (0, 1, 2), q_len=6)]
PREFIX = [7, 4]
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 4   # head_dim 4 < keys per request: several probe passes


def backends():
    out = ["torch"]
    from harness.engine.attn.sglang_triton import available
    if available():
        out.append(pytest.param("sglang-triton", marks=pytest.mark.sglang))
    return out


def probe(backend_name, builder=flat_custom_mask):
    req_to_token = torch.arange(1, 41).view(2, 20)
    loc = torch.arange(200, 212)
    vb = build_verify_batch(TREES, PREFIX, [0, 1], req_to_token, loc, builder)
    backend = make_backend(backend_name, "cpu", torch.float32)
    vis = probe_visibility(backend, vb.attn, HEADS, KV_HEADS, HEAD_DIM)
    slots = [req_to_token[b, :p].tolist() + loc[b * 6:(b + 1) * 6].tolist() for b, p in enumerate(PREFIX)]
    return [diff_request(b, vis[b], t, slots[b], backend.mask_regions) for b, t in enumerate(TREES)], vis


@pytest.mark.parametrize("backend_name", backends())
def test_probe_recovers_the_tree_mask_exactly(backend_name):
    diffs, vis = probe(backend_name)
    for d, t, p in zip(diffs, TREES, PREFIX):
        assert d.clean
        assert torch.equal(d.effective, ancestor_mask(t, p))


@pytest.mark.parametrize("backend_name", backends())
def test_probe_names_leaked_padding_keys_and_their_slots(backend_name):
    diffs, _ = probe(backend_name, faults._mask_padding_visible)
    d = diffs[0]
    assert not d.blocked
    assert {c for _, c in d.leaked} == {7 + 4, 7 + 5}           # the two padding columns
    assert {r for r, _ in d.leaked} == {0, 1, 2, 3}             # every real row
    assert [d.key_roles[c] for c in (7, 8, 11)] == ["root", "node:1", "padding:4"]
    assert d.key_slots[11] == 204 and d.key_slots[0] == 1
    ev = Evidence("step 0, request 0, node 0 (depth 0)", "node", 0, TREES[0].num_rows, probes=diffs, node=0)
    cause = classify(ev)
    assert cause.cls == "padding-leak" and "keys 4-5" in cause.text and "204-205" in cause.text


@pytest.mark.parametrize("backend_name", backends())
def test_probe_reads_a_row_stride_shift(backend_name):
    diffs, _ = probe(backend_name, faults._mask_row_stride)
    d = diffs[1]
    assert d.leaked or d.blocked
    assert row_stride_explains(d, TREES[1].num_rows) == 3        # prefix + real rows
    assert classify(Evidence("x", "node", 1, TREES[1].num_rows, probes=[d])).cls == "mask-shift"


def test_probe_sees_empty_rows_on_a_backend_that_reads_the_prefix():
    diffs, vis = probe("torch", faults._mask_padding_rows_empty)
    assert diffs[0].empty_rows == [4, 5] and not diffs[0].leaked and not diffs[0].blocked
    assert classify(Evidence("x", "node", 0, 4, probes=diffs)).cls == "fully-masked-row"


def test_rectangle_mask_is_named_by_which_requests_stay_right():
    diffs, _ = probe("torch", faults._mask_rectangle)
    assert diffs[0].clean and not diffs[1].clean                 # request 0 has the longest prefix
    assert classify(Evidence("x", "node", 1, 3, probes=diffs)).cls == "batch-mask-layout"


def test_relabelled_mask_reveals_a_child_numbered_before_its_parent():
    vb = faults._inputs_then(faults._relabel_reversed)(TREES, PREFIX, [0, 1], torch.arange(1, 41).view(2, 20),
                                                       torch.arange(200, 212), flat_custom_mask)
    vis = probe_visibility(make_backend("torch", "cpu", torch.float32), vb.attn, HEADS, KV_HEADS, HEAD_DIM)
    d = diff_request(0, vis[0], TREES[0], [0] * 13, frozenset({"prefix", "draft"}))
    parents = derived_parents(d, 4)
    assert parents == [-1, 3, 0, 0]                              # row 1 (node 3) hangs under row 3 (node 1)
    ev = Evidence("x", "node", 0, 4, inputs=audit_inputs(vb, TREES)[0], probes=[d])
    assert ev.inputs.kind == "permuted" and classify(ev).cls == "node-order"


def test_input_audit_names_wrong_positions():
    vb = faults._inputs_then(faults._positions_from_index)(TREES, PREFIX, [0, 1], torch.arange(1, 41).view(2, 20),
                                                           torch.arange(200, 212), flat_custom_mask)
    found = audit_inputs(vb, TREES)
    assert set(found) == {0} and found[0].kind == "positions" and "3 (depth 2) at 10 not 9" in found[0].text


