"""The oracle's own DDTree: the `budget` most probable draft prefixes.

A node is a prefix (t_1 .. t_d) of draft tokens, each t_j among the `topk`
most probable tokens of depth j's draft distribution; its score is
sum_j log q_j(t_j). Scores only fall along a path (log q <= 0), so the
`budget` best prefixes always form a tree under the root.

Tie rule (documented, deterministic): prefixes are ranked by score, higher
first; equal scores by depth, shallower first; then by their rank tuple
(r_1 .. r_d), where r_j is t_j's position in depth j's top-k (0 = most
probable; within one depth, equal log-probs are ranked by token id, lower
first). Rows come out in that order, so every parent precedes its children.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class ReferenceTree(NamedTuple):
    """tokens, parents (-1 for the root), depths: one entry per row, root first;
    scores: each row's summed draft log-prob (0.0 for the root)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]

    def paths(self) -> list[tuple[int, ...]]:
        """Each row's draft tokens from depth 1 down to the row (the root: ())."""
        out: list[tuple[int, ...]] = []
        for row, parent in enumerate(self.parents):
            out.append(() if parent < 0 else out[parent] + (self.tokens[row],))
        return out


def ranked_candidates(draft_logprobs: Tensor, topk: int) -> list[list[tuple[float, int]]]:
    """Per depth, the top-k (log-prob, token), best first, ties by lower token id.
    draft_logprobs  # [L, vocab]

    Only tokens at or above each depth's k-th largest log-prob can be among
    its top k, so those (ties at the threshold included) are the only ones
    sorted: the same ranking as sorting the whole vocabulary, without a
    Python sort over 128k tokens per depth."""
    rows = draft_logprobs.to(torch.float64)
    if rows.isnan().any():
        raise ValueError("draft log-probs hold NaN: no ranking exists")
    k = min(topk, rows.shape[-1])
    out = []
    for row in rows:
        threshold = torch.topk(row, k).values[-1]                       # the k-th largest log-prob
        tokens = torch.nonzero(row >= threshold).flatten().tolist()     # every token that can rank in the top k
        values = row[tokens].tolist()
        order = sorted(range(len(tokens)), key=lambda i: (-values[i], tokens[i]))[:k]
        out.append([(values[i], tokens[i]) for i in order])
    return out


def best_first_tree(root_token: int, draft_logprobs: Tensor, budget: int, topk: int) -> ReferenceTree:
    """The root plus the `budget` best prefixes (fewer when the depth cap and
    topk allow fewer), ordered as the tie rule above says."""
    if budget < 1 or topk < 1:
        raise ValueError("budget and topk must be >= 1")
    candidates = ranked_candidates(draft_logprobs, topk)
    depth_cap = len(candidates)
    tree = ReferenceTree([int(root_token)], [-1], [0], [0.0])
    ranks: list[tuple[int, ...]] = [()]
    # frontier: every child of every chosen row that is not chosen yet
    frontier = {(r,): (candidates[0][r][0], 0) for r in range(len(candidates[0]))} if depth_cap else {}
    while frontier and len(tree.tokens) - 1 < budget:
        best = min(frontier, key=lambda rk: (-frontier[rk][0], len(rk), rk))
        score, parent = frontier.pop(best)
        depth = len(best)
        tree.tokens.append(candidates[depth - 1][best[-1]][1])
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.scores.append(score)
        ranks.append(best)
        if depth < depth_cap:
            row = len(tree.tokens) - 1
            for r, (lp, _) in enumerate(candidates[depth]):
                frontier[best + (r,)] = (score + lp, row)
    return tree
