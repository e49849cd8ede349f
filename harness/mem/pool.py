"""KV memory in SGLang's layout: a token-slot KV pool, a slot allocator with a
free list, and the req_to_token table (page size 1)."""
from __future__ import annotations

import torch

from ddschema import ModelConfig

PADDING_SLOT = 0  # never handed out; graph batch padding writes its K/V here (as SGLang does)


class OutOfSlots(RuntimeError):
    pass


class SlotAllocator:
    """Free list over KV slots 1..num_slots-1. Tracks ownership so that a
    double free or a free of an unowned slot is an error, not a silent leak."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, PADDING_SLOT, -1))
        self._owned: set[int] = set()

    def alloc(self, n: int) -> torch.Tensor:
        if n > len(self._free):
            raise OutOfSlots(f"asked for {n} KV slots, {len(self._free)} free")
        slots = [self._free.pop() for _ in range(n)]
        self._owned.update(slots)
        return torch.tensor(slots, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        for s in slots.tolist():
            if s not in self._owned:
                raise ValueError(f"free of KV slot {s}, which is not allocated")
            self._owned.remove(s)
            self._free.append(s)

    @property
    def owned(self) -> frozenset[int]:
        return frozenset(self._owned)

    @property
    def num_free(self) -> int:
        return len(self._free)


class KVPool:
    """Per-layer K and V buffers, k_buffer[layer]  # [num_slots, kv_heads, head_dim]."""

    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: str) -> None:
        shape = (num_slots, cfg.num_kv_heads, cfg.head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.allocator = SlotAllocator(num_slots)

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffer[layer][loc] = k.to(self.k_buffer[layer].dtype)
        self.v_buffer[layer][loc] = v.to(self.v_buffer[layer].dtype)


class ReqToTokenPool:
    """req_to_token  # [max_reqs, max_context] KV slot of each committed position."""

    def __init__(self, max_reqs: int, max_context: int, device: str) -> None:
        self.req_to_token = torch.zeros((max_reqs, max_context), dtype=torch.int64, device=device)
        self._free = list(range(max_reqs - 1, -1, -1))
        self.max_context = max_context

    def alloc(self) -> int:
        if not self._free:
            raise OutOfSlots("no free request slot")
        return self._free.pop()

    def free(self, idx: int) -> None:
        self.req_to_token[idx].zero_()
        self._free.append(idx)
