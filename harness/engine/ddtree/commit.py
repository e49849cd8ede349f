"""Stage 6, KV commit: accepted rows' K/V become the next committed positions.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import torch

from harness.engine.mem.allocator import SlotAllocator
from harness.engine.mem.pool import ReqToTokenPool
from harness.engine.ddtree.accept import Acceptance


def commit_kv(req_to_token: ReqToTokenPool, allocator: SlotAllocator, req_pool_idx: int,
              seq_len: int, row_slots: torch.Tensor, acceptance: Acceptance) -> int:
    """Re-point req_to_token at the accepted rows' slots (page size 1) and free
    every other slot of the request's verify rows. K was cached after RoPE at
    prefix + depth, which is the committed position, so no copy is needed.

    row_slots  # [q_len] out_cache_loc of this request's verify rows
    Returns the new committed length.
    """
    rows = torch.tensor(acceptance.rows, dtype=torch.int64)
    n = rows.numel()
    req_to_token.req_to_token[req_pool_idx, seq_len:seq_len + n] = row_slots[rows].to(req_to_token.req_to_token.device)
    keep = torch.zeros(row_slots.numel(), dtype=torch.bool)
    keep[rows] = True
    allocator.free(row_slots[~keep].cpu())
    return seq_len + n
