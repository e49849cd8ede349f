"""What the oracle keeps of the trees it judged: a step judged in one pass,
answered per request, and the greedy choices those trees already decided.

Both are the oracle's own results, keyed by the exact token sequences they
are functions of, so a later question about the same sequence gets the
same answer without recomputing it:

* StepAnswers: a step's trees judged together (DenseOracle.prepare_step);
  each tree's logits wait for the tree_logits call that asks for them. Only
  the last prepared step is held.
* GreedyMemo: a node's logits are those of the causal forward over
  prefix + root_path(node), so its argmax (and top-1 minus top-2 gap) is the
  greedy continuation of that sequence. The nodes along the oracle's own
  greedy walk of each judged tree are kept; DenseOracle.greedy reads them
  instead of recomputing the positions the steps already judged.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch
from torch import Tensor

from reference.accept import greedy_acceptance
from reference.packed import PackedTree, forward_many
from reference.prefix_cache import CausalPrefix, JudgedTree, PrefixCache

TreeKey = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def tree_key(prefix: Sequence[int], tokens: Sequence[int], parents: Sequence[int]) -> TreeKey:
    return tuple(int(t) for t in prefix), tuple(int(t) for t in tokens), tuple(int(p) for p in parents)


def judge_packed(model, prefixes: PrefixCache, trees: Sequence[TreeKey],
                 memo: "GreedyMemo | None" = None) -> list[Tensor]:
    """Each tree's node logits [n, V] float64 on CPU, all trees in ONE forward
    (reference/packed.py forward_many) behind their longest cached prefixes (a
    prefix that runs along a tree judged before takes its nodes' K/V); the
    committed tokens a cache entry lacks ride in the same pass and extend it,
    and `memo` keeps the greedy choice after the last of them. Each tree's
    nodes' K/V are kept for the prefixes that run along it next."""
    prefixes.capacity = max(prefixes.capacity, 2 * len(trees))   # a step's prefixes all stay cached
    bases = [prefixes.longest(prefix) for prefix, _, _ in trees]
    packs = [PackedTree(prefix[len(base.tokens):], tokens, parents, base.past)
             for (prefix, tokens, parents), base in zip(trees, bases)]
    results = forward_many(model, packs)
    for pack, base, result in zip(packs, bases, results):
        committed = base
        if pack.more:
            committed = _extended(base, pack.more, result)
            prefixes.put(committed)
            if memo is not None:
                memo.note_next(base.tokens + pack.more, result.last_commit.cpu())
        m = len(pack.more)   # the nodes' rows follow the `more` rows: the next step's prefix runs along them
        prefixes.put_tree(JudgedTree(committed, pack.tokens, pack.parents, tuple(k[m:] for k in result.ks),
                                     tuple(v[m:] for v in result.vs)))
    return [r.logits.cpu() for r in results]


def _extended(base: CausalPrefix, more: tuple[int, ...], result) -> CausalPrefix:
    """base + more, the `more` rows' K/V [m, kv_heads, d] per layer (a packed forward's first m rows) appended."""
    m = len(more)
    if not base.tokens:
        return CausalPrefix(more, tuple(k[:m] for k in result.ks), tuple(v[:m] for v in result.vs))
    return CausalPrefix(base.tokens + more, tuple(torch.cat([a, k[:m]]) for a, k in zip(base.ks, result.ks)),
                        tuple(torch.cat([a, v[:m]]) for a, v in zip(base.vs, result.vs)))


class StepAnswers:
    """One prepared step's logits per (model, tree), each handed out once."""

    def __init__(self) -> None:
        self._held: dict[tuple, Tensor] = {}

    def replace(self, answers: dict[tuple, Tensor]) -> None:
        self._held = dict(answers)

    def take(self, which, key: TreeKey) -> Tensor | None:
        return self._held.pop((which, key), None)


class GreedyMemo:
    """sequence -> (the oracle's greedy next token, its top-1 minus top-2 gap), from judged trees."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._next: OrderedDict[tuple[int, ...], tuple[int, float]] = OrderedDict()
        self.hits = 0

    def note(self, prefix: Sequence[int], tokens: Sequence[int], parents: Sequence[int], logits: Tensor) -> None:
        """Keep every node of the oracle's greedy walk over a judged tree (logits [n, V] float64)."""
        walk = greedy_acceptance(tokens, parents, logits)
        sequence = tuple(int(t) for t in prefix)
        for j, row in enumerate(walk.rows):
            sequence += (int(tokens[row]),)
            nxt = int(tokens[walk.rows[j + 1]]) if j + 1 < len(walk.rows) else walk.bonus
            self._keep(sequence, (nxt, walk.gaps[j]))

    def note_next(self, sequence: Sequence[int], logits: Tensor) -> None:
        """Keep the greedy choice after `sequence` from its last position's logits [V] float64."""
        walk = greedy_acceptance([0], [-1], logits[None, :])   # a one-node walk: the argmax and its gap
        self._keep(tuple(int(t) for t in sequence), (walk.bonus, walk.gaps[0]))

    def _keep(self, sequence: tuple[int, ...], choice: tuple[int, float]) -> None:
        self._next[sequence] = choice
        self._next.move_to_end(sequence)
        while len(self._next) > self.capacity:
            self._next.popitem(last=False)

    def lookup(self, sequence: Sequence[int]) -> tuple[int, float] | None:
        found = self._next.get(tuple(int(t) for t in sequence))
        self.hits += found is not None
        return found
