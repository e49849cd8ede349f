"""The oracle's own greedy acceptance over a verify tree.

Walk from the root: at the current row take the oracle's argmax (ties to the
lowest token id); if a child of the row carries that token, move to it (two
children with the same token: the lower row), else stop. The argmax at the
last row is the bonus token. Each step of the walk records the oracle's
top-1 minus top-2 logit at its row, so a caller can tell a real disagreement
from a near tie.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor


class ReferenceAcceptance(NamedTuple):
    rows: list[int]     # accepted rows, root first
    bonus: int          # the oracle's argmax at the last accepted row
    gaps: list[float]   # per accepted row: oracle top-1 minus top-2 logit (inf for vocab 1)


def greedy_acceptance(tokens: Sequence[int], parents: Sequence[int], logits: Tensor) -> ReferenceAcceptance:
    """tokens, parents: the tree (parents[0] = -1); logits  # [n, vocab] float64, row i = node i."""
    children: dict[int, list[int]] = {}
    for row in range(1, len(tokens)):
        children.setdefault(int(parents[row]), []).append(row)
    rows, gaps = [0], []
    while True:
        cur = rows[-1]
        row = logits[cur].to(torch.float64)  # [vocab]
        best = int(torch.argmax(row))  # the first maximum: the lowest token id
        others = torch.cat((row[:best], row[best + 1:]))  # [vocab - 1]
        gaps.append(float(row[best] - others.max()) if others.numel() else float("inf"))
        nxt = next((c for c in children.get(cur, []) if int(tokens[c]) == best), None)
        if nxt is None:
            return ReferenceAcceptance(rows, best, gaps)
        rows.append(nxt)
