"""KV memory in SGLang's layout: the token-slot KV pool and the req_to_token
table (slots: allocator.py at page size 1, paged.py in pages).

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import torch

from ddschema import ModelConfig
from harness.engine.mem.allocator import PADDING_SLOT, OutOfSlots
from harness.engine.mem.latent import kv_buffers
from harness.engine.mem.paged import make_allocator
from harness.engine.mem.provenance import SlotProvenance, poison_slots


class KVPool:
    """Per-layer K and V buffers, k_buffer[layer]  # [num_slots, kv_heads, head_dim]
    (MLA: one latent per slot, V a view of K's first kv_lora_rank columns: latent.py),
    with the provenance of every slot (harness/engine/mem/provenance.py). With
    `poison`, free slots hold NaN (every slot but the padding slot at the
    start, each slot again when it is freed)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: str,
                 poison: bool = False, page_size: int = 1) -> None:
        self.k_buffer, self.v_buffer = kv_buffers(cfg, num_slots, dtype, device)
        self.poison = poison
        self.provenance = SlotProvenance(num_slots)
        self.page_size = page_size
        self.allocator = make_allocator(num_slots, page_size, on_free=self._on_free)  # by page size
        if poison:
            self._on_free(torch.arange(PADDING_SLOT + 1, num_slots))

    def _on_free(self, slots: torch.Tensor) -> None:
        self.provenance.freed(slots)
        if self.poison:
            poison_slots(self.k_buffer, self.v_buffer, slots)

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffer[layer][loc] = k.to(self.k_buffer[layer].dtype)
        self.v_buffer[layer][loc] = v.to(self.v_buffer[layer].dtype)
        self.mark_written(layer, loc)

    def mark_written(self, layer: int, loc: torch.Tensor) -> None:
        """Slots `loc` hold fresh K/V (written here, or by a serving backend's own KV save on this storage)."""
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
