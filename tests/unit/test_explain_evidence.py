"""Explanations from evidence (issue 9, item 1): the verify metadata against
SGLang's rules quantity by quantity, every static graph buffer against eager,
the KV audit in the paragraph, and bugs outside the fault catalog (stages
swapped here) named by their first wrong quantity and stage, never by a
catalog class."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness.check.differential import check

from harness.check.prepare import derive, prepare
from harness.engine.ddtree.accept import Acceptance, greedy_walk
from harness.engine.ddtree.mask import flatten_blocks, request_mask_block
from harness.engine.ddtree.verify_inputs import build_verify_batch
from harness.check.localize.explain import Cause, Evidence, explanation
from harness.check.localize.graph_audit import audit_graph
from harness.check.localize.kv_audit import KVAudit, Violation
from harness.check.localize.metadata_audit import acceptance, commit, verify_inputs
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings

BRANCHY = dict(backend="torch", budget=8, topk=2, max_new_tokens=6)


def first_round(**kw):
    p = prepare(RunSettings(**{**BRANCHY, **kw}))
    return p, next(p.engine.rounds())


def _one(found, quantity):
    hits = [w for w in found if w.quantity == quantity]
    assert hits, f"{quantity} not reported: {[w.quantity for w in found]}"
    w = hits[0]
    assert w.expected != w.found and w.text
    return w


def test_verify_metadata_is_audited_quantity_by_quantity():
    p, result = first_round(batch=2)
    engine, vb = p.engine, result.batch
    assert verify_inputs(engine, result) == [] and commit(engine, result) == []
    assert acceptance(engine, result, p.oracle) == []
    a = vb.attn

    def bump(t, i, d=1):
        t = t.clone()
        t[i] += d
        return t
    edits = {"qo_indptr": dict(attn=replace(a, qo_indptr=bump(a.qo_indptr, 1))),
             "kv_indptr": dict(attn=replace(a, kv_indptr=bump(a.kv_indptr, 1, -1))),
             "kv_indices": dict(attn=replace(a, kv_indices=a.kv_indices.flip(0))),
             "mask_indptr": dict(attn=replace(a, mask_indptr=bump(a.mask_indptr, 1, vb.q_len))),
             "positions": dict(positions=bump(vb.positions, 1)),
             "input_ids": dict(input_ids=bump(vb.input_ids, 2)),
             "out_cache_loc": dict(attn=replace(a, out_cache_loc=a.out_cache_loc.roll(1))),
             "seq_lens": dict(seq_lens=bump(vb.seq_lens, 0))}
    for quantity, edit in edits.items():
        found = verify_inputs(engine, replace(result, batch=replace(vb, **edit)))
        w = _one(found, quantity)
        assert w.stage == "build_verify_batch" and w.index is not None, quantity
    kv = _one(verify_inputs(engine, replace(result, batch=replace(vb, attn=replace(
        a, kv_indices=a.kv_indices.flip(0))))), "kv_indices")
    assert "request 1's position" in kv.text            # the slot is named by whose position it holds
    r2t = engine.req_pool.req_to_token
    rs = result.requests[0]
    pos = len(rs.prefix)
    idx = engine.requests[rs.rid].req_pool_idx
    r2t[idx, pos] += 1000
    w = _one(commit(engine, result), "req_to_token")
    assert w.stage == "commit" and w.expected[0] == rs.row_slots[0] and w.found[0] == rs.row_slots[0] + 1000


def test_every_static_graph_buffer_is_compared_with_eager():
    p, result = first_round(cuda_graph=True, batch=3)
    replay = p.engine.graph.last
    r2t = p.engine.req_pool.req_to_token.cpu()
    assert audit_graph(replay, r2t, 0) == []
    meta = replay.meta
    for quantity, buf, i in (("input_ids", replay.input_ids, 1), ("positions", replay.positions, 1),
                             ("kv_indptr", meta.kv_indptr, 1), ("kv_indices", meta.kv_indices, 0),
                             ("mask_indptr", meta.mask_indptr, 1), ("custom_mask", meta.custom_mask, 0),
                             ("out_cache_loc", meta.out_cache_loc, 0)):
        old = buf[i].clone()
        buf[i] = 1 - buf[i] if buf.dtype == torch.uint8 else buf[i] + 3
        found = audit_graph(replay, r2t, 0)
        buf[i] = old
        w = _one(found, quantity)
        assert w.stage == "graph" and w.index == i, quantity
        if quantity == "kv_indptr":
            _one(found, "seq_lens")                     # seq_lens are what the static kv_indptr implies
    assert audit_graph(replay, r2t, 0) == []


def test_kv_audit_violations_reach_the_explanation():
    kv = KVAudit([Violation(2, "kv_indices", "request 0: the kernel's kv_indices differ from req_to_token[:9] "
                                             "at positions [3]")])
    text = explanation(Evidence("step 2, request 0, node 1 (depth 1)", "node", kv=kv),
                       Cause("unknown", "unknown", None, "cause"))
    assert "KV audit: step 2: request 0: the kernel's kv_indices differ" in text


def run(pipeline_edit=None, **kw):
    p = prepare(RunSettings(**{**BRANCHY, **kw}))
    if pipeline_edit:   # a fresh engine over the same weights, built with the swapped stage
        p = derive(p, pipeline=pipeline_edit(p.engine.pipeline))
    w = RecordWriter(None)
    summary = check(p, w)
    assert not summary.passed
    return summary


def _siblings_visible(trees, prefix_lens):
    """Not a catalog fault: every real row also sees its siblings' keys."""
    blocks = []
    for t, p in zip(trees, prefix_lens):
        block = request_mask_block(t, p)
        for r in range(1, t.num_rows):
            for s in range(1, t.num_rows):
                if s != r and t.parents[s] == t.parents[r]:
                    block[r, p + s] = True
        blocks.append(block)
    return flatten_blocks(blocks)


def test_a_mask_bug_outside_the_catalog_is_not_given_a_catalog_name():
    s = run(lambda pl: replace(pl, build_mask=_siblings_visible))
    # mask-visibility names what was measured, it is no catalog class
    assert (s.stage, s.quantity, s.fault_class) == ("mask", "custom_mask", "mask-visibility"), s.explanation
    assert "Catalog class" not in s.explanation
    assert "gained sibling keys" in s.explanation and "mask-shift" not in s.explanation


def _indptr_one_row_late(trees, prefix_lens):
    """A correct flat mask whose mask_indptr starts every later request one row late."""
    mask, indptr = flatten_blocks([request_mask_block(t, p) for t, p in zip(trees, prefix_lens)])
    shift = torch.tensor([0] + [p + trees[0].q_len for p in prefix_lens[:-1]]).cumsum(0)
    return torch.cat([mask, torch.ones(int(shift[-1]), dtype=torch.bool)]), indptr + torch.cat([shift, shift[-1:]])


def test_an_indptr_bug_with_a_right_mask_is_not_the_rectangle_bug():
    s = run(lambda pl: replace(pl, build_mask=_indptr_one_row_late), batch=2)
    assert (s.stage, s.quantity) == ("mask", "mask_indptr") and s.fault_class == "unknown", s.explanation
    assert "max_prefix + q_len" not in s.explanation


def _walk_stops_early(tree, predicts):
    """The walk gives up one node before greedy does; its bonus is that node's token (the stream stays right)."""
    full = greedy_walk(tree, predicts)
    if len(full.rows) < 2:
        return full
    return Acceptance(full.rows[:-1], predicts[full.rows[-2]])


def test_a_walk_that_stops_early_is_the_accept_stage_not_wrong_bonus():
    s = run(lambda pl: replace(pl, accept=_walk_stops_early), budget=16, topk=1, max_new_tokens=12)
    assert (s.stage, s.quantity, s.fault_class) == ("accept", "accepted_rows", "unknown"), s.explanation


def _positions_one_late(trees, seq_lens, req_pool_indices, req_to_token, out_cache_loc, mask_builder):
    """Positions prefix + depth + 1 (not the catalog's prefix + row index)."""
    vb = build_verify_batch(trees, seq_lens, req_pool_indices, req_to_token, out_cache_loc, mask_builder)
    return replace(vb, positions=vb.positions + 1)


def test_positions_off_by_one_are_a_position_offset_not_wrong_position():
    s = run(lambda pl: replace(pl, build_verify_batch=_positions_one_late))
    # a constant offset is the catalog's position-base-offset, not the row-index positions of wrong-position
    assert (s.stage, s.quantity, s.fault_class) == ("verify inputs", "positions", "position-offset"), s.explanation
    assert "not prefix + depth" in s.explanation


class _DoubleScale:
    """A backend that scales the scores by 2/sqrt(d) (a softmax-scale slip): the mask is applied right."""

    def __init__(self, inner):
        self.inner, self.name, self.mask_regions = inner, inner.name, inner.mask_regions
        self.graph_capturable = inner.graph_capturable

    def forward(self, q, k, v, layer, k_buffer, v_buffer, meta, *layer_attn):
        return self.inner.forward(q * 2, k, v, layer, k_buffer, v_buffer, meta, *layer_attn)


def test_a_backend_scale_slip_is_the_attention_stage():
    s = run(lambda pl: replace(pl, attention=_DoubleScale))   # the pipeline's attention seam wraps the kernel
    assert (s.stage, s.quantity, s.fault_class) == ("attention", "attention_output", "unknown"), s.explanation


@pytest.mark.parametrize("name,cls", [("padded-kv-visible", "padding-leak"), ("no-kv-compaction", "kv-not-compacted")])
def test_catalog_faults_keep_their_class_after_stage_and_quantity(name, cls):
    from harness.workflows.fault_selftest import base_settings, fault_settings
    s = check(prepare(fault_settings(name, base_settings("torch", quick=True))), RecordWriter(None))
    assert s.fault_class == cls and s.stage and s.quantity
    assert s.explanation.index("First wrong quantity") < s.explanation.index(f"Catalog class: {cls}")


def _indptr_one_row_too_far(trees, prefix_lens):
    """Every block's start steps one mask row too far: the torch backend reads past the buffer and raises."""
    mask, indptr = flatten_blocks([request_mask_block(t, p) for t, p in zip(trees, prefix_lens)])
    rows = torch.tensor([0] + [p + t.q_len for t, p in zip(trees, prefix_lens)]).cumsum(0)
    return mask, indptr + rows


def test_an_engine_crash_still_names_the_wrong_verify_input_it_was_handed():
    s = run(lambda pl: replace(pl, build_mask=_indptr_one_row_too_far), batch=2)
    assert s.fault_class == "crash" and s.crash["side"] == "engine", s.explanation
    assert (s.stage, s.quantity) == ("mask", "mask_indptr"), s.explanation
    assert s.explanation.startswith("First wrong quantity: mask_indptr") and "raised" in s.explanation
