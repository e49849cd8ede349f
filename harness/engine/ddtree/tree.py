"""Stage 2, build tree: DDTree's best-first selection of the `budget` most
probable draft prefixes (Ringel and Romano, arXiv 2604.12989, section 3).

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    """A verify tree: row 0 is the root (the bonus token, not yet cached),
    rows 1.. are draft nodes in pop order, so parent < child.

    `q_len` is the verify width (budget + 1); rows num_rows..q_len-1 are
    padding rows, which have no token, parent or depth of their own.
    """

    tokens: tuple[int, ...]          # [num_rows] row 0 = root
    parents: tuple[int | None, ...]  # [num_rows] None only for the root
    depths: tuple[int, ...]          # [num_rows] root depth 0
    q_len: int

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if not (len(self.parents) == len(self.depths) == n) or n < 1:
            raise ValueError("tokens, parents and depths must have one entry per row, root included")
        if self.parents[0] is not None or self.depths[0] != 0:
            raise ValueError("row 0 must be the root (no parent, depth 0)")
        for i in range(1, n):
            p = self.parents[i]
            if p is None or not 0 <= p < i:
                raise ValueError(f"row {i}: parent {p} must be an earlier row")
            if self.depths[i] != self.depths[p] + 1:
                raise ValueError(f"row {i}: depth {self.depths[i]} is not its parent's + 1")
        if self.q_len < n:
            raise ValueError(f"q_len {self.q_len} is smaller than the {n} real rows")

    @property
    def num_rows(self) -> int:
        """Real rows, root included."""
        return len(self.tokens)

    @property
    def num_padding(self) -> int:
        return self.q_len - self.num_rows

    def children(self, row: int) -> list[int]:
        return [i for i in range(1, self.num_rows) if self.parents[i] == row]

    def ancestors(self, row: int) -> list[int]:
        """Root-to-row path, row included."""
        path = [row]
        while (p := self.parents[path[-1]]) is not None:
            path.append(p)
        return path[::-1]


def build_tree(root_token: int, draft_logprobs: torch.Tensor, budget: int, topk: int) -> DraftTree:
    """Best-first DDTree build.

    draft_logprobs  # [L, vocab] per-depth log-probabilities from the drafter
    Keeps the `budget` highest-scoring prefixes, score = sum of log q_d(u_d),
    with at most `topk` candidates per depth. The heap holds rank tuples; each
    pop adds a node, then pushes its next sibling and its first child.
    """
    if budget < 1 or topk < 1:
        raise ValueError("budget and topk must be >= 1")
    depth_cap, vocab = draft_logprobs.shape
    k = min(topk, vocab)
    top_lp, top_tok = torch.topk(draft_logprobs.double(), k, dim=-1)  # [L, k] each
    top_lp, top_tok = top_lp.tolist(), top_tok.tolist()

    tokens, parents, depths = [root_token], [None], [0]
    # heap entry: (-score, tiebreak, depth, rank, parent_row, parent_score)
    heap = [(-top_lp[0][0], 0, 1, 0, 0, 0.0)]
    counter = 1
    while heap and len(tokens) - 1 < budget:
        neg, _, d, r, parent, parent_score = heapq.heappop(heap)
        row = len(tokens)
        tokens.append(top_tok[d - 1][r])
        parents.append(parent)
        depths.append(d)
        if r + 1 < k:
            heapq.heappush(heap, (-(parent_score + top_lp[d - 1][r + 1]), counter, d, r + 1, parent, parent_score))
            counter += 1
        if d < depth_cap:
            heapq.heappush(heap, (neg - top_lp[d][0], counter, d + 1, 0, row, -neg))
            counter += 1
    return DraftTree(tuple(tokens), tuple(parents), tuple(depths), q_len=budget + 1)


def expected_num_nodes(budget: int, topk: int, depth_cap: int, vocab: int) -> int:
    """actual = min(B, sum_{d=1..L} K^d)."""
    k = min(topk, vocab)
    return min(budget, sum(k ** d for d in range(1, depth_cap + 1)))
