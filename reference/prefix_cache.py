"""Reusing a causal prefix's float64 K/V: correct by construction.

In a causal forward the K and V of position t depend only on tokens 0..t, so
the K/V a forward over `prefix` computed are exactly those a forward over
`prefix + more` computes for its first len(prefix) positions. A verify step's
nodes all extend the step's committed prefix, and the next step's prefix
extends this one's: the prefix is computed once and extended, never redone.
The arithmetic is the model's own (DenseLlama.forward with `past`).

A judged tree's nodes are causal positions too: a packed step gives node i
the K/V of position P + depth(i) of a forward over prefix + root_path(i)
(reference/packed.py: each row sees exactly its own path). The tokens a step
commits are a root path of its tree, so the next step's prefix is this
step's extended by rows already computed (JudgedTree.along), not by a
forward over them again.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class CausalPrefix:
    """The K/V of a causal forward over `tokens` (positions 0..P-1)."""

    tokens: tuple[int, ...]
    ks: tuple[Tensor, ...]  # per layer [P, kv_heads, head_dim], K after RoPE
    vs: tuple[Tensor, ...]  # per layer [P, kv_heads, head_dim]

    def __post_init__(self) -> None:
        if len(self.ks) != len(self.vs) or any(k.shape[0] != len(self.tokens) for k in self.ks):
            raise ValueError("a CausalPrefix holds one [P, kv_heads, d] K and V per layer, P = len(tokens)")

    @property
    def past(self) -> tuple[list[Tensor], list[Tensor]] | None:
        """What DenseLlama.forward takes as `past` (None for the empty prefix)."""
        return (list(self.ks), list(self.vs)) if self.tokens else None


@dataclass(frozen=True)
class JudgedTree:
    """A tree judged behind `prefix` in one causal pass: node i's K/V are those of position
    len(prefix.tokens) + depth(i) of a causal forward over prefix.tokens + root_path(i)."""

    prefix: CausalPrefix
    tokens: tuple[int, ...]
    parents: tuple[int, ...]   # parents[0] == -1, parents[i] < i
    ks: tuple[Tensor, ...]     # per layer [n, kv_heads, head_dim], the nodes' K after RoPE
    vs: tuple[Tensor, ...]     # per layer [n, kv_heads, head_dim]

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.parents) != n or len(self.ks) != len(self.vs) or any(k.shape[0] != n for k in self.ks):
            raise ValueError("a JudgedTree holds one [n, kv_heads, d] K and V per layer for its n nodes")

    def along(self, tokens: tuple[int, ...]) -> CausalPrefix | None:
        """The CausalPrefix of prefix.tokens + the longest root path of this tree that `tokens` continues
        prefix.tokens with (its nodes' rows appended), or None where `tokens` does not continue it."""
        p = len(self.prefix.tokens)
        if len(tokens) <= p or tokens[:p] != self.prefix.tokens or tokens[p] != self.tokens[0]:
            return None
        rows = [0]
        for token in tokens[p + 1:]:
            child = next((i for i in range(rows[-1] + 1, len(self.tokens))
                          if self.parents[i] == rows[-1] and self.tokens[i] == token), None)
            if child is None:
                break
            rows.append(child)
        index = torch.tensor(rows, device=self.ks[0].device)
        path = tuple(self.tokens[i] for i in rows)
        if not self.prefix.tokens:
            return CausalPrefix(path, tuple(k[index] for k in self.ks), tuple(v[index] for v in self.vs))
        return CausalPrefix(self.prefix.tokens + path,
                            tuple(torch.cat([a, k[index]]) for a, k in zip(self.prefix.ks, self.ks)),
                            tuple(torch.cat([a, v[index]]) for a, v in zip(self.prefix.vs, self.vs)))


class PrefixCache:
    """The last few CausalPrefix objects, longest-match reuse, and the last few
    judged trees they can be extended along.

    `get(model, tokens)` returns the CausalPrefix of `tokens`, extending the
    longest cached one that `tokens` starts with. At most `capacity` entries
    (and as many trees) are kept, least recently used dropped, so memory stays
    bounded.
    """

    def __init__(self, capacity: int = 8) -> None:
        if capacity < 1:
            raise ValueError("a PrefixCache holds at least one prefix")
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, ...], CausalPrefix] = OrderedDict()
        self._trees: OrderedDict[tuple, JudgedTree] = OrderedDict()

    def get(self, model, tokens: Sequence[int]) -> CausalPrefix:
        tokens = tuple(int(t) for t in tokens)
        base = self._longest_cached(tokens)
        if len(base.tokens) < len(tokens):
            base, _ = extend(model, base, tokens[len(base.tokens):])
        self.put(base)
        return base

    def put(self, entry: CausalPrefix) -> None:
        self._entries[entry.tokens] = entry
        self._entries.move_to_end(entry.tokens)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def put_tree(self, tree: JudgedTree) -> None:
        """Keep a judged tree's node K/V: a later prefix that runs along one of its root paths takes them."""
        key = (tree.prefix.tokens, tree.tokens, tree.parents)
        self._trees[key] = tree
        self._trees.move_to_end(key)
        while len(self._trees) > self.capacity:
            self._trees.popitem(last=False)

    def longest(self, tokens) -> CausalPrefix:
        """The longest cached CausalPrefix that `tokens` starts with (the empty one when none), computing no
        forward (one extended along a judged tree is kept as an entry)."""
        return self._longest_cached(tuple(int(t) for t in tokens))

    def _longest_cached(self, tokens: tuple[int, ...]) -> CausalPrefix:
        best = CausalPrefix((), (), ())
        for key, entry in self._entries.items():
            if len(best.tokens) < len(key) <= len(tokens) and tokens[:len(key)] == key:
                best = entry
        for key, tree in reversed(self._trees.items()):   # the most recent tree first
            if len(key[0]) < len(tokens):   # a tree behind a shorter prefix may still reach further
                along = tree.along(tokens)
                if along is not None and len(along.tokens) > len(best.tokens):
                    best = along
                    self.put(best)
        return best


def extend(model, prefix: CausalPrefix, more: Sequence[int]) -> tuple[CausalPrefix, Tensor]:
    """(the CausalPrefix of prefix.tokens + more, the logits [V] of its last
    position), computing only `more`."""
    result = model.forward(list(more), past=prefix.past, last_logits_only=True)
    more = tuple(int(t) for t in more)
    if not prefix.tokens:
        return CausalPrefix(more, tuple(result.ks), tuple(result.vs)), result.logits[-1]
    ks = tuple(torch.cat([a, b]) for a, b in zip(prefix.ks, result.ks))
    vs = tuple(torch.cat([a, b]) for a, b in zip(prefix.vs, result.vs))
    return CausalPrefix(prefix.tokens + more, ks, vs), result.logits[-1]
