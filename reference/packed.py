"""A whole verify step in one pass over the weights: every request's tree
nodes packed, each row seeing exactly its own causal path.

A tree node's logits are, by definition, the last position of a causal
forward over prefix + root_path(node). Causality makes that position a
function of what it sees alone: its own token at its own position, and the
K/V of the positions before it on its path. So one forward over
`more + nodes` of a request, behind the cached K/V of its committed prefix,
gives every node's definition at once when row i sees

    * every cached prefix key,
    * every `more` key (the committed tokens the cache lacks, causal among
      themselves and judged by none; their K/V extend the cache),
    * its ancestors' keys and its own (the packed path mask),

at RoPE position P + len(more) + depth(i). No row sees a sibling's key, so
no node's row mixes anything its path lacks. Every request of a step is a
segment of the same pass (DenseLlama.decoder_layer): the projections and
the MLP read each weight once for all of them; attention runs per request.
The arithmetic is DenseLlama's own; only the rows a matmul holds differ, so
a result can differ from the per-node forward in the last bits of a sum
(tests hold both equal to 1e-12).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from reference.model import Segment, window_visibility


@dataclass(frozen=True)
class PackedTree:
    """One request's rows in a packed step: the committed tokens the cached
    `past` lacks, then the tree's nodes (parents[0] == -1, parents[i] < i)."""

    more: tuple[int, ...]
    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    past: tuple[list[Tensor], list[Tensor]] | None = None   # per layer K, V [P, kv_heads, d]

    @property
    def length(self) -> int:
        return len(self.more) + len(self.tokens)


class PackedResult(NamedTuple):
    """One request's share of a packed forward.

    logits:      [n, V] float64, its nodes' rows
    last_commit: [V] float64, the logits of the last `more` row (the greedy
                 choice after the committed prefix), None without `more` rows
    ks, vs:      per layer [m + n, kv_heads, d] (K after RoPE); the first m extend its cached prefix
    """

    logits: Tensor
    last_commit: Tensor | None
    ks: list[Tensor]
    vs: list[Tensor]


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth below the root (root 0), parents in topological order."""
    out: list[int] = []
    for i, parent in enumerate(parents):
        out.append(0 if i == 0 else out[int(parent)] + 1)
    return out


def packed_visibility(n_more: int, parents: Sequence[int]) -> Tensor:
    """[m + n, m + n] bool (m = n_more, n = nodes): row sees column.
    `more` rows: causal among themselves; node rows: every `more` column, and
    their ancestors' columns and their own."""
    m, n = n_more, len(parents)
    mask = torch.zeros(m + n, m + n, dtype=torch.bool)
    mask[:m, :m] = torch.ones(m, m, dtype=torch.bool).tril()
    mask[m:, :m] = True
    for i in range(n):
        parent = int(parents[i])
        if parent >= 0:
            mask[m + i, m:] = mask[m + parent, m:]   # the parent's path (parent < i: already written)
        mask[m + i, m + i] = True
    return mask


def packed_segment(model, tree: PackedTree) -> Segment:
    """The DenseLlama Segment of one request's packed rows behind its past."""
    c, m = model.config, len(tree.more)
    ids = torch.tensor(list(tree.more) + list(tree.tokens), dtype=torch.long)  # [T]
    if ids.numel() and (ids.min() < 0 or ids.max() >= c.vocab_size):
        raise ValueError(f"token ids must lie in [0, {c.vocab_size})")
    p = 0 if tree.past is None else tree.past[0][0].shape[0]
    pos = torch.tensor(list(range(p, p + m)) + [p + m + d for d in depths(tree.parents)])  # [T]
    t = pos.numel()
    mask = torch.cat([torch.ones(t, p, dtype=torch.bool), packed_visibility(m, tree.parents)], dim=1)  # [T, P+T]
    key_pos = torch.cat([torch.arange(p), pos])  # [P+T]
    windowed = None
    if c.sliding_window is not None:
        windowed = (mask & window_visibility(pos, key_pos, c.sliding_window)).to(model.device)  # [T, P+T]
    return Segment(ids, t, mask.to(model.device), windowed, model._rope_tables(pos))


def forward_many(model, trees: Sequence[PackedTree]) -> list[PackedResult]:
    """Every request's packed rows through the model in one pass: per tree
    its nodes' logits and the last `more` row's (no other `more` row gets
    logits), and its rows' K/V (PackedResult)."""
    if not trees:
        return []
    segs = [packed_segment(model, tr) for tr in trees]
    ids = torch.cat([s.ids for s in segs]).to(model.device)  # [N]
    h = model.embed(model.w["model.embed_tokens.weight"][ids])  # [N, hidden]
    ks: list[list[Tensor]] = [[] for _ in trees]
    vs: list[list[Tensor]] = [[] for _ in trees]
    for layer in range(model.config.num_layers):
        pasts = [None if tr.past is None else (tr.past[0][layer], tr.past[1][layer]) for tr in trees]
        h, k, v = model.decoder_layer(layer, h, segs, pasts)
        for i in range(len(trees)):
            ks[i].append(k[i])
            vs[i].append(v[i])
    ends = torch.tensor([s.length for s in segs]).cumsum(0).tolist()  # [S] each segment's end row
    # per tree: the last `more` row (if any), then its node rows
    counts = [len(tr.tokens) + bool(tr.more) for tr in trees]
    rows = torch.cat([torch.arange(e - c, e) for c, e in zip(counts, ends)]).to(h.device)  # [sum(counts)]
    logits = model.head(h[rows]).split(counts)  # each [(1 +) n, V]
    return [PackedResult(lg[1:] if tr.more else lg, lg[0] if tr.more else None, ks[i], vs[i])
            for i, (tr, lg) in enumerate(zip(trees, logits))]
