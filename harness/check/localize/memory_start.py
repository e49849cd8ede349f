"""The engine's KV memory replaced from its construction: the KV pool (per-layer K/V buffers in the engine's
layout), its allocator and the req_to_token table, each built and sized here, from the run's settings and
prompts alone, never from the numbers the engine computed (its pool_slots, its max_context, its request count).
The proof of a crash the engine's memory raised while the engine was built (a pool sized negative, too small or
too large, an allocator refusing the page size, a request table with no free row), and of one that ran the pool
dry at a step: once built, the run goes on as the KV allocation rung runs it (memory_rungs.py
strict_allocation_throughout: every row on a fresh slot, the commit replaced, the cache rebuilt after each round).

Used twice: in-process by the KV allocation crash rung (crash_rungs.kv_allocation_rung: its run derived under
own_kv_memory), and in a rerun's new process by the "KV allocation" from-start replacement
(harness/check/from_start.py: enter_for_process, for the rest of that dedicated process). Imports nothing of
prepare.py: from_start.py, which prepare.py imports, imports this module.

Why through loop.py's names: Engine.__init__ builds its memory itself, in lines a mutation sample is anchored on
(harness/engine/loop.py: pool_slots, KVPool, ReqToTokenPool called in the constructor); no seam hands it other
memory without moving those lines. The loop module binds the three names at import, and the constructor looks
them up there when it runs: own_kv_memory puts the replacements under those names for the construction and puts
the engine's own back after. Each replacement takes the engine's call signature and ignores the sizes passed.

Independent of what it replaces: nothing of harness/engine/mem/pool.py, paged.py or allocator.py's allocator is
called (only latent.py's buffer layout, provenance.py's canary and the padding slot's number, not under test).

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

import harness.engine.loop as loop
from harness.check.localize.memory_rungs import SlotLedgerError, StrictSlots, pool_on_free
from harness.engine.mem.latent import kv_buffers
from harness.engine.mem.provenance import SlotProvenance, poison_slots

# slack positions past a request's greatest need (its prompt, max_new_tokens, one round's accepted rows)
MARGIN = 16
# the names Engine.__init__ looks its memory up by, in harness/engine/loop.py
SWAPPED = ("pool_slots", "KVPool", "ReqToTokenPool")


@dataclass(frozen=True)
class MemorySizes:
    """The replacement's own sizes, from the settings and the prompts."""

    requests: int      # rows of req_to_token: one per prompt, and a spare
    context: int       # positions of one request's row: longest prompt + max_new_tokens + budget + 1 + MARGIN
    slots: int         # KV slots, the padding slot 0 included: every request's context and one round's rows


def memory_sizes(s, prompt_ids: list[list[int]]) -> MemorySizes:
    """s: RunSettings; prompt_ids: the run's prompts' token ids. The verify width is the DDTree's, budget + 1."""
    width = s.budget + 1
    n = len(prompt_ids)
    context = max(map(len, prompt_ids)) + s.max_new_tokens + width + MARGIN
    return MemorySizes(n + 1, context, 1 + n * (context + width))


class OwnKVPool:
    """k_buffer[layer]  # [slots, kv_heads, head_dim] and v_buffer (MLA: latent.py's layout), the provenance of
    every slot, and a StrictSlots ledger over the buffers' slots (token slots whatever the run's page size: the
    rows stage is the rung's, memory_rungs.CommitFromIds). With `poison`, every slot but the padding slot holds
    NaN from the start, and each again when freed (memory_rungs.pool_on_free)."""

    page_size = 1   # token slots: nothing here is laid out in pages

    def __init__(self, cfg, num_slots: int, dtype: torch.dtype, device: str, poison: bool) -> None:
        self.k_buffer, self.v_buffer = kv_buffers(cfg, num_slots, dtype, device)
        self.poison = poison
        self.provenance = SlotProvenance(num_slots)
        self.allocator = StrictSlots(num_slots, on_free=pool_on_free(self))
        if poison:
            poison_slots(self.k_buffer, self.v_buffer, torch.arange(1, num_slots))

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """loc  # [rows]; k, v  # [rows, kv_heads, head_dim]"""
        self.k_buffer[layer][loc] = k.to(self.k_buffer[layer].dtype)
        self.v_buffer[layer][loc] = v.to(self.v_buffer[layer].dtype)
        self.mark_written(layer, loc)

    def mark_written(self, layer: int, loc: torch.Tensor) -> None:
        """Slots `loc` hold fresh K/V; stamped with who wrote them by the writer. Never during a CUDA graph's
        capture (no host copy there; the replay's writes are stamped after it)."""
        if layer == 0 and not (loc.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.provenance.written(loc)


class OwnRequestTable:
    """req_to_token  # [requests, context] int64: the KV slot of each request's committed positions; rows handed
    out lowest first, a row freed only once and only when handed out."""

    def __init__(self, requests: int, context: int, device: str) -> None:
        self.req_to_token = torch.zeros((requests, context), dtype=torch.int64, device=device)
        self.max_context = context
        self._free = list(range(requests))
        self._held: set[int] = set()

    def alloc(self) -> int:
        if not self._free:
            raise SlotLedgerError(f"no free request row of {self.req_to_token.shape[0]}")
        idx = self._free.pop(0)
        self._held.add(idx)
        return idx

    def free(self, idx: int) -> None:
        if idx not in self._held:
            raise SlotLedgerError(f"free of request row {idx}, which is not handed out")
        self._held.remove(idx)
        self.req_to_token[idx].zero_()
        self._free.append(idx)


def replacements(s, sizes: MemorySizes) -> dict:
    """The three names' stand-ins for settings `s`, with the engine's call signatures, each ignoring the sizes it
    is passed: `sizes` are the replacement's own."""

    def pool_slots(num_requests: int, max_context: int, q_len: int, page_size: int) -> int:
        return sizes.slots

    def kv_pool(cfg, num_slots: int, dtype: torch.dtype, device: str, poison: bool = False,
                page_size: int = 1) -> OwnKVPool:
        return OwnKVPool(cfg, sizes.slots, s.torch_dtype, s.device, s.kv_poison)

    def req_to_token_pool(max_reqs: int, max_context: int, device: str) -> OwnRequestTable:
        return OwnRequestTable(sizes.requests, sizes.context, s.device)
    return {"pool_slots": pool_slots, "KVPool": kv_pool, "ReqToTokenPool": req_to_token_pool}


@contextmanager
def own_kv_memory(s, prompt_ids: list[list[int]]) -> Iterator[MemorySizes]:
    """While inside, an Engine built (harness/engine/loop.py) gets this module's memory, sized for settings `s`
    and these prompts; the engine's own names are back after, whatever raised."""
    sizes = memory_sizes(s, prompt_ids)
    stand_ins = replacements(s, sizes)
    own = {name: getattr(loop, name) for name in SWAPPED}
    for name in SWAPPED:
        setattr(loop, name, stand_ins[name])
    try:
        yield sizes
    finally:
        for name, value in own.items():
            setattr(loop, name, value)


# the rerun's process: the replacement entered once and never left (the process runs that rerun only)
_PROCESS = ExitStack()


def enter_for_process(s, prompt_ids: list[list[int]]) -> MemorySizes:
    """own_kv_memory for the rest of this process: every engine built after it gets this memory, sized for `s`
    and these prompts (a localizer's rerun of the same run in that process too, without the rung's hooks: those
    are the caller's to install on the engine it builds)."""
    return _PROCESS.enter_context(own_kv_memory(s, prompt_ids))

