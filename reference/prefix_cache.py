"""Reusing a causal prefix's float64 K/V: correct by construction.

In a causal forward the K and V of position t depend only on tokens 0..t, so
the K/V a forward over `prefix` computed are exactly those a forward over
`prefix + more` computes for its first len(prefix) positions. A verify step's
nodes all extend the step's committed prefix, and the next step's prefix
extends this one's: the prefix is computed once and extended, never redone.
The arithmetic is the model's own (DenseLlama.forward with `past`).
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


class PrefixCache:
    """The last few CausalPrefix objects, longest-match reuse.

    `get(model, tokens)` returns the CausalPrefix of `tokens`, extending the
    longest cached one that `tokens` starts with. At most `capacity` entries
    are kept (least recently used dropped), so memory stays bounded.
    """

    def __init__(self, capacity: int = 8) -> None:
        if capacity < 1:
            raise ValueError("a PrefixCache holds at least one prefix")
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, ...], CausalPrefix] = OrderedDict()

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

    def longest(self, tokens) -> CausalPrefix:
        """The longest cached CausalPrefix that `tokens` starts with (the empty one when none), computing nothing."""
        return self._longest_cached(tuple(int(t) for t in tokens))

    def _longest_cached(self, tokens: tuple[int, ...]) -> CausalPrefix:
        best = CausalPrefix((), (), ())
        for key, entry in self._entries.items():
            if len(best.tokens) < len(key) <= len(tokens) and tokens[:len(key)] == key:
                best = entry
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
