"""The parts of a verify round that differ by setting, each chosen once when
the engine is built, so the round itself reads as the method's stages:

- where the round's verify rows write their K/V and how the accepted ones are
  kept: whole slots (page size 1) committed per request, the same slots
  committed by a port's own batched commit, or branch regions of whole pages
  compacted at commit (page size > 1, harness/engine/ddtree/verify_slots.py);
- the sliding-window fold of the verify batch (none without a window);
- how a request's acceptance is read: the pipeline's walk, or the walk with a
  port's batched bonus read.

Owns these choices; imports only the engine's own stages and memory.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from harness.engine.ddtree.accept import Acceptance
from harness.engine.ddtree.tree import DraftTree
from harness.engine.ddtree.verify_inputs import VerifyBatch
from harness.engine.mem.pool import KVPool, ReqToTokenPool
from harness.engine.pipeline import Pipeline


@dataclass(frozen=True)
class PlacedRows:
    """A round's verify rows in the pool."""

    loc: torch.Tensor                 # [bs*q_len] out_cache_loc of every row, on the run's device
    placements: tuple = ()            # per request, the paged placement (page size > 1); () otherwise


class RowSlots(Protocol):
    """Where a round's verify rows go, and how the accepted ones are committed.
    `requests` are the engine's live requests (req_pool_idx, seq_len); commit
    sets each request's new seq_len."""

    def place(self, requests: list, trees: list[DraftTree]) -> PlacedRows: ...

    def commit(self, requests: list, trees: list[DraftTree], accs: list[Acceptance], rows: PlacedRows) -> None: ...


@dataclass(frozen=True)
class TokenSlots:
    """Page size 1: the rows take bs*q_len free slots; each request keeps its
    accepted rows with the pipeline's per-request commit."""

    pipeline: Pipeline
    pool: KVPool
    req_pool: ReqToTokenPool
    q_len: int
    device: str

    def place(self, requests: list, trees: list[DraftTree]) -> PlacedRows:
        return PlacedRows(self.pool.allocator.alloc(len(requests) * self.q_len).to(self.device))

    def commit(self, requests: list, trees: list[DraftTree], accs: list[Acceptance], rows: PlacedRows) -> None:
        loc, q = rows.loc.cpu(), self.q_len
        for b, (r, acc) in enumerate(zip(requests, accs)):
            r.seq_len = self.pipeline.commit(self.req_pool, self.pool.allocator, r.req_pool_idx, r.seq_len,
                                             loc[b * q:(b + 1) * q], acc)


@dataclass(frozen=True)
class PortCommitSlots(TokenSlots):
    """Page size 1 with a port's own batched commit: its code copies the K/V,
    so the KV canary does not judge the positions it committed (the port
    audit checks those bytes)."""

    def commit(self, requests: list, trees: list[DraftTree], accs: list[Acceptance], rows: PlacedRows) -> None:
        lens = self.pipeline.commit_batch(self.req_pool, self.pool, [r.req_pool_idx for r in requests],
                                          [r.seq_len for r in requests], rows.loc.cpu(), trees, accs)
        for r, n in zip(requests, lens):
            self.pool.provenance.written(self.req_pool.req_to_token[r.req_pool_idx, r.seq_len:int(n)])
            r.seq_len = int(n)


@dataclass(frozen=True)
class PagedSlots(TokenSlots):
    """Page size > 1: each branch of a tree in a region of whole pages, laid
    out by position; the commit compacts the winning branch."""

    def place(self, requests: list, trees: list[DraftTree]) -> PlacedRows:
        r2t = self.req_pool.req_to_token
        loc, placed = self.pipeline.place_rows(self.pool.allocator, self.pool, trees, [r.seq_len for r in requests],
                                               [r2t[r.req_pool_idx, :r.seq_len].cpu() for r in requests])
        return PlacedRows(loc.to(self.device), tuple(placed))

    def commit(self, requests: list, trees: list[DraftTree], accs: list[Acceptance], rows: PlacedRows) -> None:
        for r, placed, acc in zip(requests, rows.placements, accs):
            r.seq_len = self.pipeline.commit_paged(self.req_pool, self.pool, r.req_pool_idx, r.seq_len, placed, acc)


def choose_row_slots(pipeline: Pipeline, pool: KVPool, req_pool: ReqToTokenPool, q_len: int, device: str,
                     page_size: int) -> RowSlots:
    """Paged regions at page size > 1 (a port's own commit is refused there
    before the engine is built); else token slots, committed by the port's
    batched commit when the pipeline has one."""
    kind = PagedSlots if page_size > 1 else PortCommitSlots if pipeline.commit_batch is not None else TokenSlots
    return kind(pipeline, pool, req_pool, q_len, device)


def choose_window(pipeline: Pipeline, sliding_window: int | None) -> Callable[[VerifyBatch], VerifyBatch]:
    """The verify batch with its window mask folded in; as it is without a window."""
    if sliding_window is None:
        return lambda vb: vb
    return lambda vb: pipeline.window(vb, sliding_window)


# (tree, predicts [bs*q_len] the batch's argmax, b, trees) -> the request's acceptance before its stop cut
AcceptRequest = Callable[[DraftTree, list[int], int, list[DraftTree]], Acceptance]


def choose_accept(accept: Callable, pipeline: Pipeline, q_len: int) -> AcceptRequest:
    """The acceptor over the request's own rows; with a port's batched bonus
    read, the bonus token replaced by the port's reading of the whole batch."""
    def own(tree: DraftTree, predicts: list[int], b: int, trees: list[DraftTree]) -> Acceptance:
        return accept(tree, predicts[b * q_len:(b + 1) * q_len])

    if pipeline.read_bonus is None:
        return own

    def with_port_bonus(tree: DraftTree, predicts: list[int], b: int, trees: list[DraftTree]) -> Acceptance:
        acc = own(tree, predicts, b, trees)
        return Acceptance(acc.rows, pipeline.read_bonus(predicts, b, q_len, trees, acc))

    return with_port_bonus
