"""KV memory (harness/engine/mem/pool.py): slot allocator, KV pool, req_to_token, and
their use by the engine loop."""
from __future__ import annotations

import pytest
import torch

from ddschema import ModelConfig
from harness.check.prepare import prepare
from harness.engine.mem.allocator import PADDING_SLOT, OutOfSlots, SlotAllocator
from harness.engine.mem.pool import KVPool, ReqToTokenPool
from harness.engine.settings import RunSettings


def committed_slots(engine) -> list[int]:
    """Slots req_to_token points at for every request still holding memory."""
    rt = engine.req_pool.req_to_token
    return [s for r in engine.requests if not r.finished for s in rt[r.req_pool_idx, :r.seq_len].tolist()]


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_engine_rounds_leak_no_slot(cuda_graph):
    """Across every round of a batch of 4, the owned slots are exactly the committed prefixes; all come back at the end."""
    s = RunSettings(budget=8, topk=2, batch=4, max_new_tokens=12, backend="torch", cuda_graph=cuda_graph)
    engine = prepare(s).engine
    alloc = engine.pool.allocator
    rounds = 0
    for result in engine.rounds():
        rounds += 1
        slots = committed_slots(engine)
        assert len(slots) == len(set(slots)), "two positions share a KV slot"
        assert PADDING_SLOT not in slots
        assert alloc.owned == frozenset(slots), f"step {result.step}: owned slots != req_to_token prefixes"
        assert alloc.num_free == alloc.num_slots - 1 - len(slots)
    assert rounds > 2 and all(r.finished for r in engine.requests)
    assert len({len(r.prompt) for r in engine.requests}) > 1, "prompts of different lengths"
    assert alloc.owned == frozenset()
    assert alloc.num_free == alloc.num_slots - 1


def test_slot_zero_is_never_handed_out():
    """PADDING_SLOT stays reserved even when every other slot is taken."""
    alloc = SlotAllocator(9)
    got = alloc.alloc(8).tolist()
    assert sorted(got) == list(range(1, 9)) and PADDING_SLOT not in got
    assert alloc.num_free == 0
    with pytest.raises(OutOfSlots):
        alloc.alloc(1)


def test_double_free_is_rejected():
    """Freeing a slot twice raises instead of putting it on the free list twice."""
    alloc = SlotAllocator(8)
    slots = alloc.alloc(3)
    alloc.free(slots[:1])
    with pytest.raises(ValueError):
        alloc.free(slots[:1])
    assert alloc.num_free == 8 - 1 - 2


def test_free_of_unallocated_or_padding_slot_is_rejected():
    """Only allocated slots may be freed; slot 0 never is."""
    alloc = SlotAllocator(8)
    with pytest.raises(ValueError):
        alloc.free(torch.tensor([3]))
    with pytest.raises(ValueError):
        alloc.free(torch.tensor([PADDING_SLOT]))
    assert alloc.num_free == 7


def test_freed_slots_are_reused():
    """A freed slot goes back on the free list and is handed out again."""
    alloc = SlotAllocator(4)
    a = alloc.alloc(3)
    alloc.free(a[1:2])
    assert alloc.alloc(1).tolist() == [a[1].item()]


def test_kv_pool_layout_and_set_kv():
    """k_buffer[layer] is [slots, kv_heads, head_dim]; set_kv writes only out_cache_loc."""
    cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=4)
    pool = KVPool(cfg, 6, torch.float32, "cpu")
    assert len(pool.k_buffer) == 2 and pool.k_buffer[0].shape == (6, 1, 4)
    k = torch.randn(2, 1, 4)
    pool.set_kv(1, torch.tensor([2, 5]), k, -k)
    assert torch.equal(pool.k_buffer[1][[2, 5]], k) and torch.equal(pool.v_buffer[1][[2, 5]], -k)
    assert not pool.k_buffer[1][[0, 1, 3, 4]].any() and not pool.k_buffer[0].any()


def test_req_to_token_pool_alloc_and_free():
    """Request rows are handed out once, freed rows are zeroed and reused, exhaustion raises."""
    rp = ReqToTokenPool(2, 5, "cpu")
    a, b = rp.alloc(), rp.alloc()
    assert {a, b} == {0, 1} and rp.req_to_token.shape == (2, 5)
    with pytest.raises(OutOfSlots):
        rp.alloc()
    rp.req_to_token[a, :3] = torch.tensor([4, 5, 6])
    rp.free(a)
    assert not rp.req_to_token[a].any()
    assert rp.alloc() == a
