"""KV memory in SGLang's layout: a token-slot KV pool, a slot allocator with a
free list, and the req_to_token table (page size 1; pages: harness/mem/paged.py)."""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from ddschema import ModelConfig

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


class KVPool:
    """Per-layer K and V buffers, k_buffer[layer]  # [num_slots, kv_heads, head_dim],
    with the provenance of every slot (harness/mem/provenance.py). With
    `poison`, free slots hold NaN (every slot but the padding slot at the
    start, each slot again when it is freed)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: str,
                 poison: bool = False, page_size: int = 1) -> None:
        from harness.mem.paged import make_allocator
        from harness.mem.provenance import SlotProvenance
        shape = (num_slots, cfg.num_kv_heads, cfg.head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.poison = poison
        self.provenance = SlotProvenance(num_slots)
        self.page_size = page_size
        self.allocator = make_allocator(num_slots, page_size, on_free=self._on_free)  # by page size
        if poison:
            self._on_free(torch.arange(PADDING_SLOT + 1, num_slots))

    def _on_free(self, slots: torch.Tensor) -> None:
        from harness.mem.provenance import poison_slots
        self.provenance.freed(slots)
        if self.poison:
            poison_slots(self.k_buffer, self.v_buffer, slots)

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffer[layer][loc] = k.to(self.k_buffer[layer].dtype)
        self.v_buffer[layer][loc] = v.to(self.v_buffer[layer].dtype)
        # until the writer stamps what it wrote (the engine does after each forward); not while a CUDA
        # graph is being captured: a host copy there is illegal, and the replay's writes are stamped after it
        if layer == 0 and not (loc.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.provenance.written(loc)


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
