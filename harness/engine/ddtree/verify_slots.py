"""Stage 3a with a paged KV pool: where each verify row writes its K/V
(out_cache_loc), as SGLang lays out tree drafts at page size > 1 (PR #26972).

The tree is cut into branches: the root's chain (each node's first child
continues its parent's branch) is branch 0, and every other child starts a
branch of its own. Each branch gets its own region of whole pages, laid out
by position: the node at depth d sits at region offset tail + d, where tail =
prefix % page_size is the length of the prefix's partial last page. Branch
0's region starts in the request's own tail page (it continues the request);
every other branch's region starts on fresh pages whose first `tail` slots
get a copy of the prefix's tail K/V, so each region is, on its own, a
page-consistent continuation of the request (a whole-page reader sees the
prefix's tail and then the branch). Offsets of depths a branch does not hold
are holes. Padding rows take a region of their own. At commit the winning
branch's region becomes the request's continuation (commit_paged.py).

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.engine.ddtree.tree import DraftTree


@dataclass(frozen=True)
class RowPlacement:
    """One request's verify rows in a paged pool."""

    row_slots: torch.Tensor            # [q_len] out_cache_loc of the rows
    branch_of_row: tuple[int, ...]     # [num_rows] the branch (region) of each real row
    regions: tuple[tuple[int, ...], ...]  # page ids of each branch's region, branch 0 first
    padding_pages: tuple[int, ...]     # the padding rows' pages
    tail_len: int                      # prefix % page_size: the prefix's partial last page
    tail_page: int | None              # the request's own last page when tail_len > 0
    page_size: int

    def slot(self, branch: int, depth: int) -> int:
        """The slot of position prefix + depth in `branch`'s region."""
        off = self.tail_len + depth
        return self.regions[branch][off // self.page_size] * self.page_size + off % self.page_size

    def round_pages(self) -> frozenset[int]:
        """Every page this round's placement touched (the old tail page included)."""
        pages = {p for r in self.regions for p in r} | set(self.padding_pages)
        return frozenset(pages | ({self.tail_page} if self.tail_page is not None else set()))


def branches(tree: DraftTree) -> list[int]:
    """branch  # [num_rows]: a node continues its parent's branch when it is the
    parent's first child (lowest row), else starts a new one (numbered in row order)."""
    out, first_child, n = [0] * tree.num_rows, {}, 1
    for i in range(1, tree.num_rows):
        par = int(tree.parents[i])
        if par not in first_child:
            first_child[par] = i
            out[i] = out[par]
        else:
            out[i], n = n, n + 1
    return out


def place_rows(allocator, pool, tree: DraftTree, prefix_len: int, prefix_slots: torch.Tensor,
               share_tail: bool = False) -> RowPlacement:
    """Allocate one request's branch regions and padding pages, copy the
    prefix's tail K/V into each branch region but the first, and give every
    row its slot. prefix_slots  # [prefix_len] req_to_token of the request.
    share_tail: every branch starts in the request's own tail page, no copy
    (a fault: branches then write over each other's tail)."""
    from harness.engine.mem.paged import move_kv
    ps = allocator.page_size
    tail = prefix_len % ps
    tail_page = int(prefix_slots[-1]) // ps if tail else None
    of_row = branches(tree)
    n_branches = max(of_row) + 1
    span = -(-(tail + max(tree.depths[:tree.num_rows]) + 1) // ps)   # pages per region
    regions = []
    for b in range(n_branches):
        own_tail = tail_page is not None and (b == 0 or share_tail)
        fresh = allocator.alloc_pages(span - 1 if own_tail else span)
        regions.append(tuple(([tail_page] if own_tail else []) + fresh))
    pad = tree.q_len - tree.num_rows
    padding_pages = tuple(allocator.alloc_pages(-(-pad // ps))) if pad else ()
    p = RowPlacement(torch.zeros(0), tuple(of_row), tuple(regions), padding_pages, tail, tail_page, ps)
    if tail:
        src = prefix_slots[prefix_len - tail:prefix_len].cpu()
        copies = [(torch.tensor(r[0]) * ps + torch.arange(tail), src) for r in regions if r[0] != tail_page]
        if copies:
            move_kv(pool, torch.cat([t for t, _ in copies]), torch.cat([s for _, s in copies]))
    slots = [p.slot(of_row[i], tree.depths[i]) for i in range(tree.num_rows)]
    pad_slots = ((torch.tensor(padding_pages, dtype=torch.int64)[:, None] * ps + torch.arange(ps)).reshape(-1)[:pad]
                 .tolist() if pad else [])
    return RowPlacement(torch.tensor(slots + pad_slots, dtype=torch.int64), p.branch_of_row, p.regions,
                        p.padding_pages, tail, tail_page, ps)


def place_batch(allocator, pool, trees: list[DraftTree], seq_lens: list[int], prefix_slots: list[torch.Tensor],
                share_tail: bool = False) -> tuple[torch.Tensor, list[RowPlacement]]:
    """out_cache_loc  # [bs*q_len], and each request's placement."""
    placed = [place_rows(allocator, pool, t, n, s, share_tail) for t, n, s in zip(trees, seq_lens, prefix_slots)]
    return torch.cat([p.row_slots for p in placed]), placed

