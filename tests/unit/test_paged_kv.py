"""Paged KV (--page-size N): the page allocator (harness/engine/mem/paged.py), the
verify rows' branch regions (harness/engine/ddtree/verify_slots.py), the compaction
at commit (harness/engine/ddtree/commit_paged.py), fault-free runs against the
oracle, the poison canary, and the two paged faults caught and named."""
from __future__ import annotations

from pathlib import Path

from dataclasses import replace

import pytest
import torch

from harness.check.differential import check

from harness.check.prepare import prepare
from harness.engine.ddtree.accept import Acceptance
from harness.engine.ddtree.commit_paged import commit_paged, compaction_plan
from harness.engine.ddtree.tree import DraftTree
from harness.engine.ddtree.verify_slots import branches, place_rows
from harness.engine.mem.paged import PageAllocator, make_allocator
from harness.engine.mem.allocator import OutOfSlots, SlotAllocator
from harness.engine.mem.pool import KVPool, ReqToTokenPool
from harness.engine.model.presets import PRESETS
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings, UsageError

PS = 4
BASE = RunSettings(backend="torch", max_new_tokens=10, topk=2, batch=2)


# -- the allocator --------------------------------------------------------------------

def test_allocator_hands_out_whole_pages_and_continues_the_tail_page():
    a = PageAllocator(8 * PS, PS)
    first = a.alloc(6)                                    # pages 1 and 2, page 0 holds the padding slot
    assert first.tolist() == [4, 5, 6, 7, 8, 9]
    assert a.owned == frozenset(range(4, 12))             # the second page's tail is the owner's too
    more = a.alloc_extend(6, int(first[-1]), 4)           # 2 slots to fill page 2, then a fresh page 3
    assert more.tolist() == [10, 11, 12, 13]
    with pytest.raises(ValueError):
        a.alloc_extend(6, 8, 1)                           # slot 8 is not at offset 1 of its page
    assert make_allocator(64, 1).__class__ is SlotAllocator and make_allocator(64, PS).__class__ is PageAllocator


def test_allocator_free_double_free_and_page_reuse():
    a = PageAllocator(4 * PS, PS)
    s = a.alloc(3 * PS)
    with pytest.raises(OutOfSlots):
        a.alloc(1)
    a.free(s[[0, 1]])                                     # two slots of page 1: the page is freed once
    assert a.owned_pages == {2, 3} and a.num_free == PS
    with pytest.raises(ValueError, match="not allocated"):
        a.free(s[[2]])                                    # the same page again: a double free
    assert a.alloc(2).tolist() == [4, 5]                  # the freed page comes back
    freed = []
    b = PageAllocator(4 * PS, PS, on_free=freed.append)
    b.free(b.alloc(1))
    assert freed[0].tolist() == [4, 5, 6, 7]              # the pool poisons every slot of a freed page


# -- branch regions --------------------------------------------------------------------

def _tree() -> DraftTree:
    # root 0; its children 1 (first: branch 0) and 2 (branch 1); 3 under 1 (branch 0); 4 under 2 (branch 1);
    # 5 under 1 (branch 2); two padding rows
    return DraftTree(tokens=(10, 11, 12, 13, 14, 15), parents=(None, 0, 0, 1, 2, 1), depths=(0, 1, 1, 2, 2, 2),
                     q_len=8)


def _pool_with_prefix(prefix_len: int):
    cfg = PRESETS["tiny"]
    pool = KVPool(cfg, 32 * PS, torch.float32, "cpu", poison=True, page_size=PS)
    req = ReqToTokenPool(2, 64, "cpu")
    slots = pool.allocator.alloc(prefix_len)
    for layer in range(cfg.num_layers):
        pool.k_buffer[layer][slots] = torch.arange(prefix_len, dtype=torch.float32)[:, None, None] + 100
        pool.v_buffer[layer][slots] = -torch.arange(prefix_len, dtype=torch.float32)[:, None, None]
    pool.provenance.stamp(slots, torch.zeros(prefix_len, dtype=torch.int64), torch.arange(prefix_len),
                          torch.arange(prefix_len) + 50)
    idx = req.alloc()
    req.req_to_token[idx, :prefix_len] = slots
    return pool, req, idx, slots


def test_branch_regions_layout():
    tree = _tree()
    assert branches(tree) == [0, 0, 1, 0, 1, 2]
    pool, _, _, prefix = _pool_with_prefix(6)             # tail: positions 4, 5 on page 2
    p = place_rows(pool.allocator, pool, tree, 6, prefix)
    tail_page = int(prefix[-1]) // PS
    assert p.tail_len == 2 and p.tail_page == tail_page
    assert p.regions[0][0] == tail_page                   # branch 0 continues the request's own tail page
    others = [r[0] for r in p.regions[1:]]
    assert tail_page not in others and len(set(others)) == 2   # every other branch: fresh pages of its own
    for r in p.regions[1:]:                               # ... starting with a copy of the tail's K/V
        copy = torch.tensor([r[0] * PS, r[0] * PS + 1])
        assert torch.equal(pool.k_buffer[0][copy], pool.k_buffer[0][prefix[4:6]])
        assert pool.provenance.position[copy].tolist() == [4, 5]
    slots = p.row_slots.tolist()
    assert len(set(slots)) == len(slots) == tree.q_len
    for i in range(tree.num_rows):                        # by position: offset (prefix + depth) % page size
        assert slots[i] % PS == (6 + tree.depths[i]) % PS
        assert slots[i] // PS in p.regions[p.branch_of_row[i]]
    assert slots[1] == tail_page * PS + 3                 # depth 1 of branch 0: the tail page's last slot
    assert slots[2] // PS == p.regions[1][0]              # depth 1 of branch 1: its own copy of the tail page
    assert all(s // PS in p.padding_pages for s in slots[tree.num_rows:])


def test_shared_tail_layout_aliases_the_branches():
    pool, _, _, prefix = _pool_with_prefix(6)
    p = place_rows(pool.allocator, pool, _tree(), 6, prefix, share_tail=True)
    assert all(r[0] == p.tail_page for r in p.regions)
    assert p.row_slots[1] == p.row_slots[2]               # the two depth-1 nodes write one slot


# -- compaction --------------------------------------------------------------------------

def _verify_writes(pool, tree, p, prefix_len: int) -> None:
    """Each row writes K = V = 1000 + row into its slot, stamped (request 0, position, token)."""
    rows = torch.arange(tree.num_rows)
    slots = p.row_slots[:tree.num_rows]
    for kb, vb in zip(pool.k_buffer, pool.v_buffer):
        kb[slots] = (1000 + rows).float()[:, None, None]
        vb[slots] = (1000 + rows).float()[:, None, None]
    pool.provenance.stamp(slots, torch.zeros(tree.num_rows, dtype=torch.int64),
                          prefix_len + torch.tensor(tree.depths), torch.tensor(tree.tokens))


def _per_token_ok(pool, r2t_row, tree, rows, prefix_len: int) -> bool:
    for j, i in enumerate(rows):
        if float(pool.k_buffer[0][int(r2t_row[prefix_len + j])].flatten()[0]) != 1000 + i:
            return False
    return True


def _page_level_ok(r2t_row, n: int) -> bool:
    """Each position at offset p % PS of its page, the positions of one page on one page."""
    s = r2t_row[:n].tolist()
    return all(s[q] % PS == q % PS and s[q] // PS == s[q - q % PS] // PS for q in range(n))


@pytest.mark.parametrize("plan, per_token", [(compaction_plan, True), ("permuted", False)])
def test_compaction_moves_accepted_kv_into_the_winning_region(plan, per_token):
    from harness.faults.catalog import _plan_permuted
    plan = _plan_permuted if plan == "permuted" else plan
    tree = _tree()
    pool, req, idx, prefix = _pool_with_prefix(6)
    p = place_rows(pool.allocator, pool, tree, 6, prefix)
    _verify_writes(pool, tree, p, 6)
    acc = Acceptance((0, 2, 4), 99)                       # root (branch 0) -> 2 -> 4 (branch 1): a cross-page move
    new = commit_paged(req, pool, idx, 6, p, acc, plan=plan)
    row = req.req_to_token[idx]
    assert new == 9
    assert _page_level_ok(row, new)                       # page-consistent either way
    assert _per_token_ok(pool, row, tree, acc.rows, 6) is per_token   # only a per-token check tells them apart
    assert row[4] // PS == p.regions[1][0]                # the tail positions now read branch 1's copy ...
    assert pool.k_buffer[0][row[4:6]][:, 0, 0].tolist() == [104.0, 105.0]   # ... of positions 4 and 5's K/V
    used = {int(s) // PS for s in row[:new]}
    assert pool.allocator.owned_pages == used             # every other page of the round is freed, whole
    assert p.tail_page not in used                        # the old tail page included
    free = torch.tensor(sorted(set(range(PS, pool.allocator.num_slots)) - pool.allocator.owned))
    assert torch.isnan(pool.k_buffer[0][free]).all()      # and poisoned


# -- end to end ----------------------------------------------------------------------------

def _sglang():
    from harness.engine.attn.sglang_triton import available
    return [pytest.param(16, "sglang-triton", marks=pytest.mark.sglang)] if available() else []


@pytest.mark.parametrize("page_size, backend", [(1, "torch"), (16, "torch"), (64, "torch")] + _sglang())
def test_fault_free_paged_run_equals_the_oracle(page_size, backend):
    moves = []

    def counting_plan(placed, acceptance):
        win, tgt, src = compaction_plan(placed, acceptance)
        moves.append(int((tgt != src).sum()))
        return win, tgt, src
    p = prepare(replace(BASE, page_size=page_size, backend=backend))
    p.engine.pipeline = replace(p.engine.pipeline, commit_paged=lambda *a: commit_paged(*a, plan=counting_plan))
    summary = check(p, RecordWriter(None))
    assert summary.passed, summary.first
    assert (sum(moves) > 0) is (page_size > 1)            # accepted K/V really moved across pages


def test_poisoned_free_slots_never_change_a_fault_free_paged_run():
    def rounds(poison: bool):
        engine = prepare(replace(BASE, page_size=16, kv_poison=poison)).engine
        return engine, [r for r in engine.rounds()]
    engine, poisoned = rounds(True)
    _, plain = rounds(False)
    assert len(poisoned) == len(plain) > 1
    for a, b in zip(poisoned, plain):
        assert not a.provenance and not b.provenance, a.provenance or b.provenance
        for ra, rb in zip(a.requests, b.requests):
            assert torch.equal(ra.logits, rb.logits), f"step {a.step}: the poison reached the logits"
    free = torch.tensor(sorted(set(range(16, engine.pool.allocator.num_slots)) - engine.pool.allocator.owned))
    assert torch.isnan(engine.pool.v_buffer[0][free]).all()
    assert not engine.finish_findings


@pytest.mark.parametrize("fault, cls", [("paged-compaction-permutation", "kv-compaction-permuted"),
                                        ("paged-branch-shared-tail", "branch-shared-tail")])
def test_paged_faults_are_caught_and_named(fault, cls):
    summary = check(prepare(replace(BASE, batch=1, page_size=16, fault=fault)), RecordWriter(None))
    assert not summary.passed and summary.fault_class == cls


def test_page_size_refusals_and_reproduce_command():
    with pytest.raises(UsageError, match="--page-size must be one of"):
        RunSettings(page_size=3)
    assert "--page-size 16" in RunSettings(page_size=16).command()
    assert "--page-size" not in RunSettings().command()


# -- with a port under test -----------------------------------------------------------

PORTS = Path(__file__).parents[1] / "fixtures" / "ports"


@pytest.mark.parametrize("impl, stages", [("dflash-tree:dflash_tree/faithful.py", None),
                                          ("ddtree-utils:ddtree_utils/faithful.py", "build,compile,accept")])
def test_a_ports_stages_run_over_paged_kv_with_ddchecks_paged_commit(impl, stages):
    family, path = impl.split(":")
    s = replace(BASE, page_size=16, impl=f"{family}:{PORTS / path}", port_stages=stages, max_new_tokens=12)
    summary = check(prepare(s), RecordWriter(None))
    assert summary.passed and summary.nodes_checked > 30 and "commit" not in summary.port["port_stages"]


def test_a_ports_own_commit_is_skipped_at_page_size_above_1():
    from harness.ports.attach import SettingSkipped
    s = replace(BASE, page_size=16, impl=f"ddtree-utils:{PORTS / 'ddtree_utils/faithful.py'}")
    with pytest.raises(SettingSkipped, match="own commit"):
        prepare(s)


def test_a_ports_padding_leak_is_caught_over_paged_kv():
    s = replace(BASE, batch=1, topk=1, page_size=16, port_stages="build,compile,accept",
                impl=f"ddtree-utils:{PORTS / 'ddtree_utils/padding_visible.py'}")
    summary = check(prepare(s), RecordWriter(None))
    assert not summary.passed and summary.fault_class == "padding-leak"
