"""The memory rungs of a crash's proof by replacement (stage_swap.prove_crash), at any page size. Each replaces
a stage from the start of the run; the other rungs (tree, mask, verify inputs, attention, graph) read the cache
through req_to_token, which maps every committed position to its slot whatever the page size, so they stand
at page size > 1 unchanged.

  commit          the rows stage keeps its placement (the engine's own: whole token slots, or branch regions
                  of pages) and its commit is replaced: every slot of the round's rows is freed (page size > 1:
                  every page of the round's branch regions and padding that holds no committed position),
                  each request's length grows by its accepted rows on fresh slots, and once the round has
                  emitted, every live request's cache is rebuilt from its token ids (rebuild_committed, below)
                  before the next round reads it
  KV allocation   the broadest: the engine's memory from its construction (memory_start.py: a KV pool, its
                  StrictSlots ledger and a req_to_token table of the rung's own, sized from the settings and
                  the prompts, not by the engine's pool_slots or its request count), then the engine's
                  allocator and its row placement, the prefill's allocations included, replaced by
                  StrictSlots, an independent token-slot allocator over that pool (its size the pool's
                  buffers'), the rows on fresh slots, and therefore the commit too, as above. A crash in the
                  allocator, its pages, the branch regions, the placement or a pool the engine sized too small
                  then runs through (a construction that raised leaves no engine to rerun here: the same memory
                  replaces it from a new process's start, check/from_start.py). It comes after the commit
                  rung: a commit bug that frees wrong (a double free the engine's allocator refuses) is the
                  commit rung's to prove, and StrictSlots refuses a double free as strictly

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from harness.check.prefill_layout import independent_prefill_metadata
from harness.engine.attn.exact import ExactAttention
from harness.engine.attn.torch_backend import TorchBackend
from harness.engine.mem.allocator import PADDING_SLOT
from harness.engine.mem.provenance import poison_slots
from harness.engine.round_stages import PlacedRows

# SGLang's padding slot: a graph replay's batch padding writes its K/V there; never handed out
SGLANG_PADDING_SLOT = 0


class SlotLedgerError(RuntimeError):
    """A free of a slot StrictSlots does not hold as handed out (a double free, a slot never handed out),
    or an alloc past the pool."""


class StrictSlots:
    """KV slots of a pool handed out one at a time, lowest first, over slots 1..num_slots-1 (the padding slot,
    SGLang's and the engine's, never). Every slot is owned by whoever it was handed to until freed; a free of
    a slot not owned (freed twice, or never handed out) raises, the whole free refused. on_free(slots  # [n])
    runs after every free (the pool's provenance and poison)."""

    def __init__(self, num_slots: int, on_free=None) -> None:
        self.num_slots = num_slots
        reserved = {SGLANG_PADDING_SLOT, PADDING_SLOT}
        self._free: deque[int] = deque(s for s in range(num_slots) if s not in reserved)
        self._owned: set[int] = set()
        self.on_free = on_free

    def alloc(self, n: int) -> torch.Tensor:
        """slots  # [n] int64, none of them owned before."""
        if n < 0 or n > len(self._free):
            raise SlotLedgerError(f"asked for {n} KV slots, {len(self._free)} free")
        slots = [self._free.popleft() for _ in range(n)]
        self._owned.update(slots)
        return torch.tensor(slots, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        """slots  # [n] (any shape), each owned and named once."""
        named = [int(s) for s in slots.reshape(-1).tolist()]
        unowned = [s for s in named if s not in self._owned]
        twice = len(named) != len(set(named))
        if unowned or twice:
            raise SlotLedgerError(f"free of KV slots {unowned[:8] if unowned else named[:8]}: "
                                  + ("not handed out, or freed already" if unowned else "a slot named twice"))
        self._owned.difference_update(named)
        self._free.extend(named)
        if self.on_free is not None and named:
            self.on_free(torch.tensor(named, dtype=torch.int64))

    @property
    def owned(self) -> frozenset[int]:
        return frozenset(self._owned)

    @property
    def num_free(self) -> int:
        return len(self._free)


def pool_on_free(pool):
    """What a free does to the pool, done by the ledger itself (not by the pool's own hook): the slots' provenance
    reset, and NaN into their K/V where the run poisons free slots."""
    def on_free(slots: torch.Tensor) -> None:
        pool.provenance.freed(slots)
        if pool.poison:
            poison_slots(pool.k_buffer, pool.v_buffer, slots)
    return on_free


@dataclass(frozen=True)
class CommitFromIds:
    """The engine's rows stage (harness/engine/round_stages.py RowSlots) with its commit replaced: the round's
    rows freed, the accepted ones taken on fresh slots (their K/V the rebuild's, after the round). `placement`:
    the engine's own rows stage whose place is kept; None: every row on a fresh slot of the pool's allocator."""

    engine: object
    placement: object | None

    def place(self, requests: list, trees: list) -> PlacedRows:
        if self.placement is not None:
            return self.placement.place(requests, trees)
        e = self.engine
        return PlacedRows(e.pool.allocator.alloc(len(requests) * e.q_len).to(e.s.device))   # [bs*q_len]

    def commit(self, requests: list, trees: list, accs: list, rows: PlacedRows) -> None:
        e = self.engine
        allocator, r2t = e.pool.allocator, e.req_pool.req_to_token
        freed = round_slots(e, rows)
        if freed.numel():
            allocator.free(freed)
        for r, acc in zip(requests, accs):
            n = len(acc.rows)
            r2t[r.req_pool_idx, r.seq_len:r.seq_len + n] = allocator.alloc(n).to(r2t.device)
            r.seq_len += n


def round_slots(engine, rows: PlacedRows) -> torch.Tensor:
    """slots  # [n] what the round's rows hold and no committed position does, each once: its rows' slots; with
    paged placements, one slot of each page of the branch regions and padding (a paged free frees the page)."""
    committed = {int(s) for r in engine.requests if not r.finished
                 for s in engine.req_pool.req_to_token[r.req_pool_idx, :r.seq_len].tolist()}
    if not rows.placements:
        return torch.tensor([s for s in dict.fromkeys(rows.loc.tolist()) if s not in committed], dtype=torch.int64)
    ps = engine.s.page_size
    pages = {p for placed in rows.placements for region in placed.regions for p in region}
    pages |= {p for placed in rows.placements for p in placed.padding_pages}
    pages -= {s // ps for s in committed}
    return torch.tensor([p * ps for p in sorted(pages)], dtype=torch.int64)


def rebuild_committed(engine) -> None:
    """Each live request's cache from its ids: its slots freed, n fresh ones taken, K/V of positions 0..n-1
    written by a causal forward over its committed tokens whose attention is a float64 softmax (not the
    backend under test) and whose metadata is laid out independently (not the engine's prefill metadata:
    harness/check/prefill_layout.py), req_to_token and seq_len set."""
    live = [r for r in engine.requests if not r.finished]
    r2t, owned = engine.req_pool.req_to_token, engine.pool.allocator.owned
    for r in live:
        old = [s for s in dict.fromkeys(r2t[r.req_pool_idx, :r.seq_len].tolist()) if s in owned]
        if old:
            engine.pool.allocator.free(torch.tensor(old, dtype=torch.int64))
            owned = engine.pool.allocator.owned
    plain = ExactAttention(TorchBackend(engine.s.device, engine.s.torch_dtype))
    for r in live:
        ids = r.committed_tokens()
        n = len(ids)
        loc = engine.pool.allocator.alloc(n).to(engine.s.device)                      # [n]
        engine.model.forward(torch.tensor(ids, device=engine.s.device), torch.arange(n, device=engine.s.device),
                             independent_prefill_metadata([n], loc).to(engine.s.device), engine.pool, plain)
        r2t[r.req_pool_idx, :n] = loc
        r.seq_len = n


def rebuilt_after_each_round(engine) -> None:
    """Once each round has emitted, every live request's cache rebuilt from its token ids."""
    rounds = engine.rounds

    def rebuilt_after_each():
        for result in rounds():
            yield result
            rebuild_committed(engine)
    engine.rounds = rebuilt_after_each


def rebuilt_commit_throughout(q, step: int):
    """The commit rung: the engine's placement, the commit replaced (CommitFromIds), the cache rebuilt after each
    round."""
    def install(engine) -> None:
        engine.rows = CommitFromIds(engine, engine.rows)
        rebuilt_after_each_round(engine)
    return install


def strict_allocation_throughout(q, step: int):
    """The KV allocation rung: StrictSlots over the pool's buffers in the allocator's place before the prefill,
    every verify row on a fresh slot of it, the commit replaced and the cache rebuilt after each round."""
    def install(engine) -> None:
        pool = engine.pool
        pool.allocator = StrictSlots(int(pool.k_buffer[0].shape[0]), on_free=pool_on_free(pool))
        engine.rows = CommitFromIds(engine, None)
        rebuilt_after_each_round(engine)
    return install
