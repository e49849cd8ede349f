"""Paged KV memory, with SGLang's paged allocator's semantics: the token-slot
pool is cut into pages of `page_size` slots (slot = page * page_size +
offset), a request owns whole pages, an extend first fills the rest of the
request's last page and then takes fresh pages, and a free releases the
pages its slots lie in. Page 0 holds the padding slot and is never handed
out. `make_allocator` picks the allocator by page size: SlotAllocator
(harness/engine/mem/pool.py) for 1, PageAllocator above.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from collections import deque
from typing import Callable, Protocol

import torch

from harness.engine.mem.allocator import PADDING_SLOT, OutOfSlots, SlotAllocator


class Allocator(Protocol):
    """What the engine and the audits use of an allocator, whatever its page size."""

    num_slots: int

    def alloc(self, n: int) -> torch.Tensor: ...
    def free(self, slots: torch.Tensor) -> None: ...
    @property
    def owned(self) -> frozenset[int]: ...
    @property
    def num_free(self) -> int: ...


class PageAllocator:
    """Free list of pages 1..num_pages-1, first in first out. Ownership is
    per page: a double free, or a free of a page nobody owns, is an error (a
    silent one in SGLang, which unions the page into its free list again).
    on_free(slots) runs with every slot of the freed pages (the pool poisons them)."""

    def __init__(self, num_slots: int, page_size: int,
                 on_free: Callable[[torch.Tensor], None] | None = None) -> None:
        if page_size < 2 or page_size & (page_size - 1):
            raise ValueError(f"page size {page_size}: a power of two >= 2 (page size 1 is SlotAllocator)")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.num_slots = self.num_pages * page_size
        self._free: deque[int] = deque(range(PADDING_SLOT // page_size + 1, self.num_pages))
        self._owned: set[int] = set()   # page ids
        self.on_free = on_free

    # -- pages ----------------------------------------------------------------
    def alloc_pages(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfSlots(f"asked for {n} KV pages of {self.page_size} slots, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        self._owned.update(pages)
        return pages

    def page_slots(self, pages: list[int]) -> torch.Tensor:
        """slots  # [len(pages) * page_size] every slot of `pages`, page by page."""
        base = torch.tensor(pages, dtype=torch.int64)[:, None] * self.page_size
        return (base + torch.arange(self.page_size)).reshape(-1)

    def free_pages(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._owned:
                raise ValueError(f"free of KV page {p} (slots {p * self.page_size}..{(p + 1) * self.page_size - 1}), "
                                 "which is not allocated")
            self._owned.remove(p)
            self._free.append(p)
        if self.on_free is not None and pages:
            self.on_free(self.page_slots(pages))

    # -- slots (the SlotAllocator interface) -------------------------------------
    def alloc(self, n: int) -> torch.Tensor:
        """n slots on fresh pages, in page order (the last page's tail stays the owner's)."""
        return self.alloc_extend(0, -1, n)

    def alloc_extend(self, prefix_len: int, last_slot: int, n: int) -> torch.Tensor:
        """Slots for positions prefix_len..prefix_len+n-1 of one request whose
        position prefix_len-1 sits in `last_slot`: the rest of that slot's page
        first (when prefix_len is not page-aligned), then fresh pages."""
        ps = self.page_size
        if n <= 0:
            return torch.zeros(0, dtype=torch.int64)
        in_tail = 0
        if prefix_len % ps:
            if last_slot < 0 or (last_slot + 1) % ps != prefix_len % ps:
                raise ValueError(f"alloc_extend: last slot {last_slot} does not sit at offset "
                                 f"{(prefix_len - 1) % ps} of its page (prefix {prefix_len}, page size {ps})")
            in_tail = min(n, ps - prefix_len % ps)
        head = torch.arange(last_slot + 1, last_slot + 1 + in_tail, dtype=torch.int64)
        rest = n - in_tail
        pages = self.alloc_pages(-(-rest // ps)) if rest else []
        tail = self.page_slots(pages)[:rest] if pages else torch.zeros(0, dtype=torch.int64)
        return torch.cat([head, tail])

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages `slots` lie in (each once), as SGLang's paged free does."""
        pages = sorted({int(s) // self.page_size for s in slots.reshape(-1).tolist()})
        self.free_pages(pages)

    @property
    def owned(self) -> frozenset[int]:
        ps = self.page_size
        return frozenset(p * ps + o for p in self._owned for o in range(ps))

    @property
    def owned_pages(self) -> frozenset[int]:
        return frozenset(self._owned)

    @property
    def num_free(self) -> int:
        return len(self._free) * self.page_size


# page size -> the allocator for it (a registry: a new layout registers, the engine never branches on it)
ALLOCATORS: dict[str, Callable[..., Allocator]] = {
    "token": lambda num_slots, page_size, on_free: SlotAllocator(num_slots, on_free=on_free),
    "paged": lambda num_slots, page_size, on_free: PageAllocator(num_slots, page_size, on_free=on_free),
}


def make_allocator(num_slots: int, page_size: int,
                   on_free: Callable[[torch.Tensor], None] | None = None) -> Allocator:
    return ALLOCATORS["token" if page_size == 1 else "paged"](num_slots, page_size, on_free)


def pool_slots(num_requests: int, max_context: int, q_len: int, page_size: int) -> int:
    """KV slots a run needs: each request's context, plus one verify round's
    rows. Paged: every page the context spans, and per round up to q_len
    branch regions of ceil((page_size - 1 + q_len) / page_size) + 1 pages
    (harness/engine/ddtree/verify_slots.py), a padding region and the old tail page."""
    if page_size == 1:
        return 2 + num_requests * (max_context + q_len) + 64
    per_branch = -(-(page_size - 1 + q_len) // page_size) + 1
    pages = -(-max_context // page_size) + q_len * per_branch + -(-q_len // page_size) + 2
    return (2 + num_requests * pages) * page_size


def move_kv(pool, tgt: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the K/V of slots src -> tgt in every layer (all read before any is
    written), and their provenance with them. tgt, src  # [n] slot ids."""
    if tgt.numel() == 0:
        return
    t, s = tgt.to(pool.k_buffer[0].device), src.to(pool.k_buffer[0].device)
    for kb, vb in zip(pool.k_buffer, pool.v_buffer):
        k, v = kb[s].clone(), vb[s].clone()
        kb[t], vb[t] = k, v
    pool.provenance.move(tgt.cpu(), src.cpu())
