"""The causal twin's KV memory: one pool for every kept prefix and every
step's scratch rows, its slots handed out from a free list and the pool
grown (slot numbers kept) when a step needs more than are free.

One pool is what lets a step's twins of every request run as one forward:
a forward reads and writes one pool, and each request's kept prefix is a
list of slots in it (in position order), not a pool of its own.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

import torch
from ddschema import ModelConfig

from harness.engine.mem.pool import KVPool

FIRST_SLOT = 1  # slot 0 stays the pool's padding slot, as in the engine's pool


class TwinSlots:
    """A KVPool (made at the first alloc) and its free slots, first in first out."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: str, min_slots: int) -> None:
        """min_slots: the pool's first size (the engine's context: one request's prefix and tree fit)."""
        self.cfg, self.dtype, self.device, self.min_slots = cfg, dtype, device, min_slots
        self.pool: KVPool | None = None
        self.free: list[int] = []

    @property
    def num_slots(self) -> int:
        return 0 if self.pool is None else self.pool.k_buffer[0].shape[0]

    def alloc(self, n: int) -> torch.Tensor:
        """n free slots [n] int64 on the pool's device, the pool grown first when fewer are free."""
        if n > len(self.free):
            self._grow(n - len(self.free))
        taken, self.free = self.free[:n], self.free[n:]
        return torch.tensor(taken, dtype=torch.int64, device=self.device)

    def release(self, slots: torch.Tensor) -> None:
        """Slots back to the free list (their K/V are left as they are: no reader is handed them again
        before a forward writes them)."""
        self.free.extend(int(s) for s in slots.tolist())

    def copy(self, slots: torch.Tensor) -> torch.Tensor:
        """New slots [n] holding, layer by layer, the K/V of `slots` (a kept prefix two asks of one step
        share: each extends its own)."""
        new = self.alloc(slots.numel())
        if not new.numel():
            return new
        for k, v in zip(self.pool.k_buffer, self.pool.v_buffer):
            k[new] = k[slots]
            if v.data_ptr() != k.data_ptr():   # MLA: V is a view of K's latent
                v[new] = v[slots]
        return new

    def _grow(self, short: int) -> None:
        """A larger pool: every slot of the old one at the same number, the new ones free."""
        old = self.num_slots
        size = max(FIRST_SLOT + self.min_slots + 1, 2 * old, old + short + 1)
        pool = KVPool(self.cfg, size, self.dtype, self.device)
        if self.pool is not None:
            for old_k, old_v, k, v in zip(self.pool.k_buffer, self.pool.v_buffer, pool.k_buffer, pool.v_buffer):
                k[:old] = old_k
                if v.data_ptr() != k.data_ptr():
                    v[:old] = old_v
        self.free.extend(range(max(old, FIRST_SLOT), size))
        self.pool = pool
