"""A crash in the KV memory layer proven by replacement (harness/check/localize/memory_rungs.py, issue 21): at
any page size, the commit rung replaces the commit (a crashing paged compaction is proven `commit`) and the
last rung, KV allocation, replaces the allocator and the row placement (a crashing allocator, page allocator
or placement is proven `KV allocation`); a commit that double-frees is the commit's, never KV allocation's.
Each stage is planted broken in the engine under test (a pipeline stage, or a memory class patched for the
run), never in the thing checked: the replaced run is compared with the oracle."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness.check.crash import PROVEN_CRASH, Crash, crash_stage
from harness.check.differential import check
from harness.check.localize import memory_rungs
from harness.check.localize.memory_rungs import SlotLedgerError, StrictSlots
from harness.check.localize.stage_swap import independent_batch, prove_crash
from harness.check.prepare import derive, prepare
from harness.check.records import RecordWriter
from harness.engine import round_stages
from harness.engine.ddtree.commit import commit_kv
from harness.engine.ddtree.commit_paged import commit_paged
from harness.engine.mem.allocator import OutOfSlots, SlotAllocator
from harness.engine.mem import paged
from harness.engine.mem.paged import PageAllocator
from harness.engine.settings import RunSettings

SETTING = RunSettings(backend="torch", budget=8, topk=2, batch=2, max_new_tokens=8, stop_after=0)
BEFORE_COMMIT = ["tree build", "mask", "verify inputs", "attention", "accept"]
LADDER = BEFORE_COMMIT + ["commit", "KV allocation"]


@pytest.fixture(scope="module")
def base():
    return prepare(replace(SETTING, stop_after=1))


def _check(base, page_size: int, **stages):
    p = derive(base, replace(SETTING, page_size=page_size), pipeline=replace(base.engine.pipeline, **stages))
    return check(p, RecordWriter(None))


def _proven(s, stage: str, tried: list[str]) -> None:
    assert s.crash is not None and s.crash["side"] == "engine", s.crash
    assert [r["stage"] for r in s.replacements] == tried, s.replacements
    assert s.replacements[-1]["correct"] and not any(r["correct"] for r in s.replacements[:-1]), s.replacements
    assert s.first.what == PROVEN_CRASH and s.stage == stage, (s.first, s.stage, s.explanation)


# -- the ledger ------------------------------------------------------------------------------------------------

def test_the_strict_ledger_refuses_a_double_free_an_unowned_free_and_an_overdraw():
    freed = []
    a = StrictSlots(8, on_free=freed.append)
    s = a.alloc(3)
    assert 0 not in s.tolist() and a.owned == frozenset(s.tolist()) and a.num_free == 4
    a.free(s[:1])
    with pytest.raises(SlotLedgerError, match="freed already"):
        a.free(s[:1])                                  # a double free
    with pytest.raises(SlotLedgerError, match="freed already"):
        a.free(torch.tensor([7]))                      # never handed out
    with pytest.raises(SlotLedgerError, match="named twice"):
        a.free(s[[1, 1]])
    assert a.owned == frozenset(s[1:].tolist())        # a refused free frees nothing
    with pytest.raises(SlotLedgerError):
        a.alloc(a.num_free + 1)
    assert [t.tolist() for t in freed] == [s[:1].tolist()]
    assert 0 not in StrictSlots(8).alloc(7).tolist()   # the padding slot is never handed out


def test_the_ledger_is_sized_by_the_pools_buffers_not_the_engines_allocator(base, monkeypatch):
    """An allocator made over too few slots (make_allocator's registry off): the prefill runs out; the ledger
    over the pool's own buffers does not."""
    monkeypatch.setitem(paged.ALLOCATORS, "token", lambda num_slots, page_size, on_free: SlotAllocator(8, on_free))
    s = _check(base, 1)
    assert "OutOfSlots" in s.crash["error"], s.crash
    _proven(s, "KV allocation", LADDER)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("rung", [memory_rungs.rebuilt_commit_throughout, memory_rungs.strict_allocation_throughout],
                         ids=["commit", "kv-allocation"])
def test_a_replaced_run_leaves_no_slot_behind(base, page_size, rung):
    """A correct run through the rung to its end: every round's rows freed (a paged round's regions and padding
    included), every request's cache freed as it retires."""
    p = derive(base, replace(SETTING, page_size=page_size))
    rung(p, 0)(p.engine)
    steps = sum(1 for _ in p.engine.rounds())
    assert steps > 1 and all(r.finished for r in p.engine.requests)
    assert not p.engine.pool.allocator.owned, sorted(p.engine.pool.allocator.owned)[:8]


# -- the rungs before the commit, at page size > 1 ------------------------------------------------------------

@pytest.mark.parametrize("page_size", [4, 16])
def test_the_independent_batch_reads_the_paged_cache_through_req_to_token(base, page_size):
    """The verify-inputs rung's batch is the engine's on a correct paged run: req_to_token maps each committed
    position to its slot whatever the page size (the attention rung reads the same keys)."""
    p = derive(base, replace(SETTING, page_size=page_size))
    seen = []
    own = p.engine.pipeline.build_verify_batch

    def both(*args):
        vb = own(*args)
        seen.append((vb, independent_batch(p.engine, *args)))
        return vb
    p.engine.pipeline = replace(p.engine.pipeline, build_verify_batch=both)
    rounds = iter(p.engine.rounds())
    next(rounds), next(rounds)   # the second round's prefix ends inside a page: its tail
    assert len(seen) == 2 and any(int(n) % page_size for _, ours in seen for n in ours.seq_lens)
    for vb, ours in seen:
        for name in ("input_ids", "positions", "seq_lens"):
            assert torch.equal(getattr(vb, name), getattr(ours, name)), name
        for name in ("kv_indptr", "kv_indices", "custom_mask", "mask_indptr"):
            assert torch.equal(getattr(vb.attn, name), getattr(ours.attn, name)), name


def _inputs_raise(*args, **kwargs):
    raise TypeError("unsupported operand type(s) for <<: 'list' and 'list'")


def test_a_crash_of_the_verify_inputs_is_proven_at_page_size_16(base):
    _proven(_check(base, 16, build_verify_batch=_inputs_raise), "verify inputs", ["tree build", "mask", "verify inputs"])


# -- the commit ------------------------------------------------------------------------------------------------

def _paged_commit_raises_from_step(first: int):
    calls = []

    def commit(req_to_token, pool, req_pool_idx, seq_len, placed, acc):
        calls.append(1)
        if len(calls) > first * SETTING.batch:
            row = req_to_token.req_to_token[req_pool_idx]
            return row[seq_len:seq_len | 99].tolist()[99]   # IndexError: a slice arithmetic off
        return commit_paged(req_to_token, pool, req_pool_idx, seq_len, placed, acc)
    return commit


@pytest.mark.parametrize("first", [0, 1])
def test_a_crashing_paged_commit_is_proven_commit(base, first):
    """At step 0, or at step 1 after a right step 0 (the replaced run's step 1 reads the cache rebuilt from the
    ids over the engine's own branch regions)."""
    s = _check(base, 4, commit_paged=_paged_commit_raises_from_step(first))
    _proven(s, "commit", LADDER[:-1])
    assert s.first.step == first, s.first


def _paged_commit_double_free(req_to_token, pool, req_pool_idx, seq_len, placed, acc):
    held = pool.allocator.owned_pages
    n = commit_paged(req_to_token, pool, req_pool_idx, seq_len, placed, acc)
    pool.allocator.free_pages([min(held - pool.allocator.owned_pages)])   # a page the commit freed already
    return n


def _token_commit_double_free(req_to_token, allocator, req, seq_len, row_slots, acc):
    held = allocator.owned
    n = commit_kv(req_to_token, allocator, req, seq_len, row_slots, acc)
    allocator.free(torch.tensor([min(held - allocator.owned)]))   # a rejected row's slot, freed already
    return n


@pytest.mark.parametrize("page_size, stages", [(4, dict(commit_paged=_paged_commit_double_free)),
                                               (1, dict(commit=_token_commit_double_free))], ids=["paged", "token"])
def test_a_commit_that_double_frees_is_the_commits_not_kv_allocations(base, page_size, stages):
    s = _check(base, page_size, **stages)
    assert "not allocated" in s.crash["error"], s.crash
    _proven(s, "commit", LADDER[:-1])


# -- KV allocation ---------------------------------------------------------------------------------------------

def _alloc_negated(self, n):
    """allocator.alloc's `if n > len(self._free)` negated (a cosmic-ray mutant): every fitting request refused."""
    if not n > len(self._free):
        raise OutOfSlots(f"asked for {n} KV slots, {len(self._free)} free")
    slots = [self._free.popleft() for _ in range(n)]
    self._owned.update(slots)
    return torch.tensor(slots, dtype=torch.int64)


def _alloc_pages_negated(self, n):
    if not n > len(self._free):
        raise OutOfSlots(f"asked for {n} KV pages of {self.page_size} slots, {len(self._free)} free")
    pages = [self._free.popleft() for _ in range(n)]
    self._owned.update(pages)
    return pages


def _slot_free_reshape_1(self, slots):
    """allocator.free's on_free(slots.reshape(-1)) as reshape(1) (a cosmic-ray mutant): a free of two slots or
    more raises."""
    for s in slots.tolist():
        self._owned.remove(s)
        self._free.append(s)
    if self.on_free is not None and slots.numel():
        self.on_free(slots.reshape(1).cpu())


def _page_free_reshape_1(self, slots):
    self.free_pages(sorted({int(s) // self.page_size for s in slots.reshape(1).tolist()}))


@pytest.mark.parametrize("page_size, cls, name, broken", [
    (1, SlotAllocator, "alloc", _alloc_negated),
    (16, PageAllocator, "alloc_pages", _alloc_pages_negated),
    (1, SlotAllocator, "free", _slot_free_reshape_1),
    (4, PageAllocator, "free", _page_free_reshape_1),
], ids=["alloc", "paged-alloc", "free", "paged-free"])
def test_a_crashing_allocator_is_proven_kv_allocation(base, monkeypatch, page_size, cls, name, broken):
    monkeypatch.setattr(cls, name, broken)
    s = _check(base, page_size)
    _proven(s, "KV allocation", LADDER)


def _page_slots_shifted(self, pages):
    """paged.page_slots' `base + arange` as `base << arange` (a cosmic-ray mutant): slots past the pool."""
    base = torch.tensor(pages, dtype=torch.int64)[:, None] * self.page_size
    return (base << torch.arange(self.page_size)).reshape(-1)


def test_a_page_allocator_handing_out_slots_past_the_pool_is_proven_kv_allocation_where_the_pool_raised(
        base, monkeypatch):
    """The raise is the pool's write (harness/engine/mem/pool.py, filed under the commit's code by
    crash.CRASH_STAGES): the explanation leads with the proven stage, not the file's."""
    monkeypatch.setattr(PageAllocator, "page_slots", _page_slots_shifted)
    s = _check(base, 16)
    assert s.crash["where"].startswith("harness/engine/mem/pool.py"), s.crash
    _proven(s, "KV allocation", LADDER)
    assert s.explanation.startswith("The KV allocation stage crashed (proven by replacement; its fault reached the "
                                    "commit stage's code, which raised): the engine under test raised"), s.explanation
    assert "The commit stage crashed" not in s.explanation


def _place_raises(allocator, pool, trees, seq_lens, prefix_slots):
    raise IndexError("index 3 is out of range")   # verify_slots' span arithmetic off: RowPlacement.slot


def _token_place_short(self, requests, trees):
    """round_stages.TokenSlots.place's alloc(len(requests) * q_len) as alloc(len(requests) | q_len)."""
    return round_stages.PlacedRows(self.pool.allocator.alloc(len(requests) | self.q_len).to(self.device))


def test_a_crashing_paged_placement_is_proven_kv_allocation(base):
    _proven(_check(base, 16, place_rows=_place_raises), "KV allocation", LADDER)


def test_a_crashing_token_placement_is_proven_kv_allocation(base, monkeypatch):
    monkeypatch.setattr(round_stages.TokenSlots, "place", _token_place_short)
    _proven(_check(base, 1), "KV allocation", LADDER)


def test_a_crash_no_memory_rung_makes_right_stays_a_crash_at_page_size_4(base):
    def stop_raises(tree, acceptance, eos_id):
        raise TypeError("'NoneType' object is not subscriptable")
    s = _check(base, 4, stop=stop_raises)
    assert [r["stage"] for r in s.replacements] == LADDER + ["model"] and not any(r["correct"] for r in s.replacements)
    assert s.first.what == "crash"


def test_the_kv_allocation_rung_alone_proves_a_paged_placement_crash(base):
    """The rung itself, called as the ladder calls it: its replaced run reaches the crashed step and matches."""
    p = derive(base, replace(SETTING, page_size=16), pipeline=replace(base.engine.pipeline, place_rows=_place_raises))
    found = prove_crash(p, 0)
    assert found[-1].stage == "KV allocation" and found[-1].correct and found[-1].error_after <= 1, \
        [r.sentence() for r in found]


def test_a_crash_in_the_branch_placement_file_names_kv_allocation():
    where = "harness/engine/ddtree/verify_slots.py:56 (slot)"
    assert crash_stage(Crash("engine", where, where, "IndexError: tuple index out of range", 0, "")) == "KV allocation"


def test_a_crash_retiring_the_last_requests_is_proven_by_a_replaced_run_that_ends_without_raising(base, monkeypatch):
    """The paged free broken (reshape(1)): at batch 1 and page size 16 only the retiring request frees through it,
    after the run's last step; the replaced run is judged at that step, ends without raising, and names the
    allocator."""
    monkeypatch.setattr(PageAllocator, "free", _page_free_reshape_1)
    p = derive(base, replace(SETTING, page_size=16, batch=1), pipeline=base.engine.pipeline)
    s = check(p, RecordWriter(None))
    assert s.crash["step"] is not None and not s.crash["in_step"], s.crash
    last = s.crash["step"]
    _proven(s, "KV allocation", LADDER)
    assert s.replacements[-1]["judged_at"] == last and s.first.step == last + 1, s.replacements[-1]
    assert f"raised after step {last}, the run's last" in s.first.detail, s.first.detail
    assert all(r["judged_at"] is None for r in s.replacements[:-1])   # the runs that raised were judged nowhere


# -- a divergent step at page size > 1 -------------------------------------------------------------------------------

def _commit_paged_last_position_elsewhere(req_to_token, pool, req_pool_idx, seq_len, placement, acceptance):
    """The paged commit, then the prefix's last position pointed at the same offset of page 0 (the padding page):
    no crash, a wrong K/V read at the next step."""
    n = commit_paged(req_to_token, pool, req_pool_idx, seq_len, placement, acceptance)
    row = req_to_token.req_to_token[req_pool_idx]
    row[seq_len - 1] = int(row[seq_len - 1]) % pool.page_size
    return n


def test_a_wrong_paged_commit_that_diverges_is_proven_commit_by_the_divergent_step_rungs(base):
    p = derive(base, replace(SETTING, page_size=16, stop_after=1),
               pipeline=replace(base.engine.pipeline, commit_paged=_commit_paged_last_position_elsewhere))
    s = check(p, RecordWriter(None))
    assert s.crash is None and s.verdict == "diverge", (s.crash, s.verdict)
    assert s.replacements and s.replacements[0]["stage"] == "commit" and s.replacements[0]["correct"], s.replacements
    assert s.stage == "commit", (s.stage, s.explanation)
