"""The engine's KV memory replaced from its construction (harness/check/localize/memory_start.py, issue 21): the
replacement sizes itself from the settings and the prompts, never from the engine's numbers; a build whose pool,
pool sizing, allocator or request table is broken raises as it is, and builds and runs to the oracle's answer
with the "KV allocation" from-start replacement (harness/check/from_start.py, DDCHECK_REPLACE_STAGE); in-process,
the KV allocation crash rung proves a pool sized too small. Each breakage is planted in the engine under test
(its memory classes or the names loop.py binds, patched for the test), never in the replacement."""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace

import pytest
import torch

import harness.engine.loop as loop
from harness.check import from_start
from harness.check.crash import PROVEN_CRASH
from harness.check.differential import check
from harness.check.localize import memory_start
from harness.check.localize.memory_start import MARGIN, OwnKVPool, OwnRequestTable, own_kv_memory
from harness.check.prepare import build, derive, prepare
from harness.check.records import RecordWriter
from harness.engine.attn.exact import REPLACE_STAGE_ENV
from harness.engine.mem import paged, pool
from harness.engine.mem.allocator import OutOfSlots
from harness.engine.mem.paged import PageAllocator
from harness.engine.settings import RunSettings

SETTING = RunSettings(backend="torch", budget=8, topk=2, batch=2, max_new_tokens=8, stop_after=0)
LADDER = ["tree build", "mask", "verify inputs", "attention", "accept", "commit", "KV allocation"]


@pytest.fixture(scope="module")
def base():
    return prepare(replace(SETTING, stop_after=1))


@pytest.fixture
def rerun_process(monkeypatch):
    """This test as a rerun's process with DDCHECK_REPLACE_STAGE="KV allocation": the replacement it enters for
    the rest of the process is left when the test ends (before monkeypatch puts the engine's names back)."""
    stack = ExitStack()
    monkeypatch.setattr(memory_start, "_PROCESS", stack)
    monkeypatch.setenv(REPLACE_STAGE_ENV, "KV allocation")
    yield
    stack.close()


# -- sizes -------------------------------------------------------------------------------------------------------

def test_the_replacement_sizes_itself_from_the_settings_and_the_prompts(base):
    """Whatever the engine passes (sizes of its own, wrong here), the pool, its ledger and the request table are
    sized from the settings and prompts; the engine's names are back after."""
    s, ids = base.settings, base.prompt_ids
    context = max(map(len, ids)) + s.max_new_tokens + s.budget + 1 + MARGIN
    slots = 1 + len(ids) * (context + s.budget + 1)
    with own_kv_memory(s, ids) as sizes:
        assert loop.pool_slots(1, 2, 3, 16) == slots
        kv = loop.KVPool(base.engine.cfg, 3, torch.float16, "cpu", poison=False, page_size=16)
        table = loop.ReqToTokenPool(0, 5, "cpu")
    assert (sizes.slots, sizes.context, sizes.requests) == (slots, context, len(ids) + 1)
    assert isinstance(kv, OwnKVPool) and isinstance(table, OwnRequestTable)
    assert kv.k_buffer[0].shape[0] == slots and kv.k_buffer[0].dtype == s.torch_dtype
    assert kv.allocator.num_free == slots - 1 and kv.provenance.owner.numel() == slots
    assert tuple(table.req_to_token.shape) == (len(ids) + 1, context)
    assert [table.alloc() for _ in range(len(ids) + 1)] == list(range(len(ids) + 1))
    assert (loop.pool_slots, loop.KVPool, loop.ReqToTokenPool) == (paged.pool_slots, pool.KVPool,
                                                                   pool.ReqToTokenPool)


def test_an_engine_built_under_the_replacement_ignores_the_engines_own_sizes(base, monkeypatch):
    monkeypatch.setattr(loop, "pool_slots", lambda num_requests, max_context, q_len, page_size: 3)
    with own_kv_memory(base.settings, base.prompt_ids) as sizes:
        engine = derive(base).engine
    assert engine.pool.k_buffer[0].shape[0] == sizes.slots and engine.pool.allocator.num_slots == sizes.slots
    assert engine.req_pool.req_to_token.shape[1] == sizes.context


# -- from the start, in a rerun's process ---------------------------------------------------------------------------

def _request_rows_step_0(self, max_reqs, max_context, device):
    """ReqToTokenPool.__init__'s free list as range(max_reqs - 1, -1, - 0) (a cosmic-ray mutant)."""
    self.req_to_token = torch.zeros((max_reqs, max_context), dtype=torch.int64, device=device)
    self._free = list(range(max_reqs - 1, -1, - 0))
    self.max_context = max_context


def _no_request_row(self, max_reqs, max_context, device):
    """ReqToTokenPool.__init__'s free list as range(max_reqs - 1, +1, -1): request row 0 and 1 never free."""
    self.req_to_token = torch.zeros((max_reqs, max_context), dtype=torch.int64, device=device)
    self._free = list(range(max_reqs - 1, +1, -1))
    self.max_context = max_context


def _break(monkeypatch, how: str) -> None:
    if how == "req-pool-range":
        monkeypatch.setattr(pool.ReqToTokenPool, "__init__", _request_rows_step_0)
    elif how == "no-request-row":
        monkeypatch.setattr(pool.ReqToTokenPool, "__init__", _no_request_row)
    elif how == "empty-pool":   # pool_slots' count 0 ((2 >> n) * page_size, a cosmic-ray mutant)
        monkeypatch.setattr(loop, "pool_slots", lambda num_requests, max_context, q_len, page_size: 0)
    elif how == "allocator-refuses":   # make_allocator's page_size == 1 as == 2: page size 1 to the page allocator
        monkeypatch.setitem(paged.ALLOCATORS, "token", lambda num_slots, page_size, on_free:
                            PageAllocator(num_slots, page_size, on_free=on_free))


BROKEN = [("req-pool-range", ValueError, "arg 3 must not be zero"), ("no-request-row", OutOfSlots, "request slot"),
          ("empty-pool", RuntimeError, "step sign"), ("allocator-refuses", ValueError, "a power of two")]


@pytest.mark.parametrize("how, raised, says", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_build_whose_memory_is_broken_raises_as_built(base, monkeypatch, how, raised, says):
    _break(monkeypatch, how)
    with pytest.raises(raised, match=says):
        build(base.settings, base.loaded)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("how", [b[0] for b in BROKEN])
def test_a_build_whose_memory_is_broken_runs_with_the_replacement_and_matches_the_oracle(base, monkeypatch,
                                                                                         rerun_process, how,
                                                                                         page_size):
    _break(monkeypatch, how)
    p = build(replace(base.settings, page_size=page_size), base.loaded)
    assert isinstance(p.engine.pool, OwnKVPool) and isinstance(p.engine.req_pool, OwnRequestTable)
    s = check(p, RecordWriter(None))
    assert s.crash is None and s.verdict == "pass", (s.crash, s.verdict, s.first)
    assert all(r.finished for r in p.engine.requests) and not p.engine.pool.allocator.owned


@pytest.mark.parametrize("frames, keys", [
    ([("harness/engine/mem/pool.py", "__init__"), ("harness/engine/loop.py", "__init__")],
     ["tree build", "KV allocation"]),   # the verify width first: it sizes the pools too
    ([("harness/engine/mem/pool.py", "alloc")], ["KV allocation"]),
    ([("harness/engine/mem/paged.py", "pool_slots")], ["KV allocation"]),
    ([("harness/engine/loop.py", "prefill")], ["verify inputs"]),
    ([("harness/engine/attn/torch_backend.py", "forward"), ("harness/engine/mem/pool.py", "set_kv")],
     ["attention", "KV allocation"]),
])
def test_the_kv_allocation_replacement_is_tried_where_a_frame_of_the_crash_is_in_the_memory(frames, keys):
    assert from_start.ladder(frames, None) == keys


def test_the_attention_from_the_start_still_builds_with_the_engines_memory(base, monkeypatch):
    monkeypatch.setenv(REPLACE_STAGE_ENV, "attention")
    p = build(base.settings, base.loaded)
    assert type(p.engine.pool) is pool.KVPool and p.engine.backend is not p.engine.kernel


# -- in-process: the KV allocation crash rung -------------------------------------------------------------------------

def test_the_kv_allocation_rung_proves_a_pool_sized_too_small(base, monkeypatch):
    """A pool with room for the prompts and not one round's rows (pool_slots wrong): the engine runs out placing its
    first round's rows; the rung's own pool, sized from the settings and prompts, runs it to the oracle's answer."""
    prompts = sum(map(len, base.prompt_ids))
    monkeypatch.setattr(loop, "pool_slots", lambda num_requests, max_context, q_len, page_size: prompts + q_len + 1)
    s = check(derive(base, replace(SETTING, stop_after=1)), RecordWriter(None))
    rows = SETTING.batch * (SETTING.budget + 1)   # the prefill fits; the first round's rows do not
    assert s.crash is not None and f"OutOfSlots: asked for {rows} KV slots" in s.crash["error"], s.crash
    assert [r["stage"] for r in s.replacements] == LADDER, s.replacements
    assert s.replacements[-1]["correct"] and not any(r["correct"] for r in s.replacements[:-1]), s.replacements
    assert s.first.what == PROVEN_CRASH and s.stage == "KV allocation", (s.first, s.stage)
