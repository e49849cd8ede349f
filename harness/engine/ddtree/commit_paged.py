"""Stage 6 with a paged KV pool: compaction. The accepted rows are a path
whose last node lies in one branch region (harness/engine/ddtree/verify_slots.py);
that region becomes the request's continuation. Each accepted row's K/V is
copied to the slot of its committed position in that region (rows of the
winning branch already sit there; their ancestors in other branches move in,
across pages, into the region's holes), the prefix's tail positions are
re-pointed at the region's copy of the tail page, and every page of the
round that no committed position uses any more is freed, whole. K is cached
after RoPE at prefix + depth, the committed position, so a byte copy is
right. Requests keep page-consistent req_to_token rows: position p lies at
offset p % page_size of its page, and positions of one page share it.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import torch

from harness.engine.ddtree.accept import Acceptance
from harness.engine.ddtree.verify_slots import RowPlacement


def compaction_plan(placed: RowPlacement, acceptance: Acceptance) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(winning branch, tgt, src): tgt  # [n] the committed positions' slots in
    the winning region; src  # [n] the accepted rows' slots, root first."""
    rows = list(acceptance.rows)
    win = placed.branch_of_row[rows[-1]]
    tgt = torch.tensor([placed.slot(win, d) for d in range(len(rows))], dtype=torch.int64)
    src = placed.row_slots[torch.tensor(rows, dtype=torch.int64)].cpu()
    return win, tgt, src


def commit_paged(req_to_token, pool, req_pool_idx: int, seq_len: int, placed: RowPlacement,
                 acceptance: Acceptance, plan=compaction_plan) -> int:
    """Move the accepted K/V into the winning region, re-point req_to_token
    and free the round's unused pages. Returns the new committed length."""
    from harness.engine.mem.paged import move_kv
    win, tgt, src = plan(placed, acceptance)
    n, ps, tail = tgt.numel(), placed.page_size, placed.tail_len
    moved = tgt != src
    move_kv(pool, tgt[moved], src[moved])
    row = req_to_token.req_to_token[req_pool_idx]
    region = placed.regions[win]
    if tail and region[0] != placed.tail_page:   # the region holds its own copy of the tail page
        row[seq_len - tail:seq_len] = (region[0] * ps + torch.arange(tail)).to(row.device)
    row[seq_len:seq_len + n] = tgt.to(row.device)
    used = {int(s) // ps for s in row[:seq_len + n].tolist()}
    pool.allocator.free_pages(sorted(placed.round_pages() - used))
    return seq_len + n
