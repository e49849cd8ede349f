"""DDTree's best-first build (harness/engine/ddtree/tree.py) against brute force."""
from __future__ import annotations

import itertools

import pytest
import torch

from harness.engine.ddtree.tree import DraftTree, build_tree, expected_num_nodes


def random_logprobs(depth_cap: int, vocab: int, seed: int) -> torch.Tensor:
    """[L, vocab] continuous random log-probabilities: no ties between scores."""
    gen = torch.Generator().manual_seed(seed)
    return torch.log_softmax(3 * torch.randn(depth_cap, vocab, generator=gen, dtype=torch.float64), -1)


def brute_force_best(lp: torch.Tensor, budget: int, topk: int) -> set[tuple[int, ...]]:
    """Every candidate prefix (depth <= L, token at depth d among the topk of
    q_d), scored by the sum of log-probabilities; the `budget` best."""
    depth_cap, vocab = lp.shape
    allowed = [torch.topk(lp[d], min(topk, vocab)).indices.tolist() for d in range(depth_cap)]
    scored = []
    for depth in range(1, depth_cap + 1):
        for path in itertools.product(*allowed[:depth]):
            scored.append((sum(float(lp[d, t]) for d, t in enumerate(path)), path))
    scored.sort(reverse=True)
    return {path for _, path in scored[:budget]}


def node_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Token path below the root of every draft node, in row order."""
    return [tuple(tree.tokens[r] for r in tree.ancestors(i)[1:]) for i in range(1, tree.num_rows)]


CASES = [(b, k, L, seed) for b in (1, 3, 7, 16, 40) for k in (1, 2, 3) for L in (1, 3, 4) for seed in (0, 1)]


@pytest.mark.parametrize("budget,topk,depth_cap,seed", CASES)
def test_build_is_the_top_budget_prefixes(budget, topk, depth_cap, seed):
    """The built nodes are exactly the `budget` highest-scoring candidate prefixes."""
    lp = random_logprobs(depth_cap, 5, seed)
    tree = build_tree(7, lp, budget, topk)
    paths = node_paths(tree)
    assert len(paths) == len(set(paths))
    assert set(paths) == brute_force_best(lp, budget, topk)


@pytest.mark.parametrize("budget,topk,depth_cap,seed", CASES)
def test_build_shape_invariants(budget, topk, depth_cap, seed):
    """parent < child, sibling tokens distinct, pop order by score, actual = min(B, sum K^d), q_len = B + 1."""
    vocab = 5
    lp = random_logprobs(depth_cap, vocab, seed)
    tree = build_tree(7, lp, budget, topk)
    assert tree.tokens[0] == 7 and tree.q_len == budget + 1
    assert tree.num_rows - 1 == expected_num_nodes(budget, topk, depth_cap, vocab)
    assert tree.num_padding == budget - (tree.num_rows - 1)
    for i in range(1, tree.num_rows):
        assert tree.parents[i] < i
        assert tree.depths[i] <= depth_cap
    for row in range(tree.num_rows):
        kids = [tree.tokens[c] for c in tree.children(row)]
        assert len(kids) == len(set(kids)) and len(kids) <= topk
    scores = [sum(float(lp[d, t]) for d, t in enumerate(p)) for p in node_paths(tree)]
    assert scores == sorted(scores, reverse=True)


def test_expected_num_nodes_formula():
    """actual = min(B, sum_{d=1..L} K^d) with K capped at the vocabulary."""
    assert expected_num_nodes(16, 1, 7, 128) == 7
    assert expected_num_nodes(16, 2, 3, 128) == 14
    assert expected_num_nodes(8, 2, 3, 128) == 8
    assert expected_num_nodes(100, 9, 2, 3) == 3 + 9


def test_topk_one_is_a_chain_of_argmaxes():
    """topk 1 builds the drafter's argmax chain, capped at depth L, padded to q_len."""
    lp = random_logprobs(4, 6, 3)
    tree = build_tree(0, lp, 16, 1)
    assert tree.parents == (None, 0, 1, 2, 3)
    assert list(tree.tokens[1:]) == lp.argmax(-1).tolist()
    assert tree.num_padding == 12


@pytest.mark.parametrize("budget,topk", [(0, 1), (4, 0), (-1, 2)])
def test_build_rejects_bad_budget_or_topk(budget, topk):
    """budget < 1 or topk < 1 is an error, not an empty tree."""
    with pytest.raises(ValueError):
        build_tree(0, random_logprobs(3, 5, 0), budget, topk)


@pytest.mark.parametrize("tokens,parents,depths,q_len", [
    ((1, 2), (None,), (0, 1), 3),              # lengths differ
    ((), (), (), 1),                           # no root
    ((1, 2), (0, 0), (0, 1), 3),               # root has a parent
    ((1, 2), (None, None), (0, 1), 3),         # non-root without parent
    ((1, 2, 3), (None, 2, 0), (0, 2, 1), 4),   # parent after child
    ((1, 2), (None, 1), (0, 1), 3),            # own parent
    ((1, 2), (None, 0), (0, 2), 3),            # depth is not parent's + 1
    ((1, 2), (None, 0), (1, 2), 3),            # root depth not 0
    ((1, 2, 3), (None, 0, 1), (0, 1, 2), 2),   # q_len below the real rows
])
def test_draft_tree_rejects_bad_construction(tokens, parents, depths, q_len):
    """DraftTree checks its invariants on construction."""
    with pytest.raises(ValueError):
        DraftTree(tokens, parents, depths, q_len)


def test_draft_tree_accessors():
    """children, ancestors and padding count of a small hand-built tree."""
    t = DraftTree((9, 4, 5, 6), (None, 0, 0, 1), (0, 1, 1, 2), q_len=6)
    assert t.children(0) == [1, 2] and t.children(1) == [3] and t.children(3) == []
    assert t.ancestors(3) == [0, 1, 3] and t.ancestors(0) == [0]
    assert t.num_rows == 4 and t.num_padding == 2
