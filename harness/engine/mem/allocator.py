"""KV slots as SGLang hands them out at page size 1: a free list with
ownership (pages: paged.py). Owns PADDING_SLOT and the allocator; imports
nothing of the engine.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch

PADDING_SLOT = 0  # never handed out; graph batch padding writes its K/V here (as SGLang does)


class OutOfSlots(RuntimeError):
    pass


class SlotAllocator:
    """Free list over KV slots 1..num_slots-1, first in first out as SGLang's
    token allocator (alloc takes the front, free appends), so a freed slot
    stays free for a while. Tracks ownership so that a double free or a free
    of an unowned slot is an error, not a silent leak. on_free(slots) runs
    after every free (the pool poisons them)."""

    def __init__(self, num_slots: int, on_free: Callable[[torch.Tensor], None] | None = None) -> None:
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(PADDING_SLOT + 1, num_slots))
        self._owned: set[int] = set()
        self.on_free = on_free

    def alloc(self, n: int) -> torch.Tensor:
        if n > len(self._free):
            raise OutOfSlots(f"asked for {n} KV slots, {len(self._free)} free")
        slots = [self._free.popleft() for _ in range(n)]
        self._owned.update(slots)
        return torch.tensor(slots, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        for s in slots.tolist():
            if s not in self._owned:
                raise ValueError(f"free of KV slot {s}, which is not allocated")
            self._owned.remove(s)
            self._free.append(s)
        if self.on_free is not None and slots.numel():
            self.on_free(slots.reshape(-1).cpu())

    @property
    def owned(self) -> frozenset[int]:
        return frozenset(self._owned)

    @property
    def num_free(self) -> int:
        return len(self._free)
