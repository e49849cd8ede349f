"""The oracle's per-depth top-k (reference/tree.py) ranks exactly as a sort of
the whole vocabulary by (-log-prob, token id) does, ties at the k-th place
included, and the best-first tree built from it is unchanged."""
from __future__ import annotations

import pytest
import torch

from reference.tree import best_first_tree, ranked_candidates


def full_sort(draft_logprobs, topk):
    out = []
    for row in draft_logprobs.double().tolist():
        order = sorted(range(len(row)), key=lambda t: (-row[t], t))[:topk]
        out.append([(row[t], t) for t in order])
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("topk", [1, 2, 4, 8])
def test_top_k_equals_sorting_the_vocabulary_with_ties(seed, topk):
    g = torch.Generator().manual_seed(seed)
    # few distinct values (bf16-like coarse log-probs): ties at and across the k-th place are common
    draft = torch.randint(-6, 0, (5, 40), generator=g).double() / 4
    assert ranked_candidates(draft, topk) == full_sort(draft, topk)


def test_ties_at_the_threshold_go_to_the_lower_token_id():
    draft = torch.tensor([[-1.0, -0.5, -2.0, -0.5, -0.5, -3.0]])
    assert ranked_candidates(draft, 2) == [[(-0.5, 1), (-0.5, 3)]]
    assert ranked_candidates(draft, 4) == [[(-0.5, 1), (-0.5, 3), (-0.5, 4), (-1.0, 0)]]


def test_topk_larger_than_the_vocabulary_and_minus_infinity():
    draft = torch.tensor([[float("-inf"), -1.0, float("-inf")]])
    assert ranked_candidates(draft, 5) == [[(-1.0, 1), (float("-inf"), 0), (float("-inf"), 2)]]


def test_nan_log_probs_are_refused():
    with pytest.raises(ValueError, match="NaN"):
        ranked_candidates(torch.tensor([[0.0, float("nan")]]), 1)


@pytest.mark.parametrize("seed", range(4))
def test_the_tree_is_the_tree_of_the_full_sort(seed, monkeypatch):
    import reference.tree as tree
    g = torch.Generator().manual_seed(seed)
    draft = torch.log_softmax(torch.randint(0, 5, (6, 64), generator=g).double(), -1)
    fast = best_first_tree(3, draft, budget=16, topk=4)
    monkeypatch.setattr(tree, "ranked_candidates", full_sort)
    assert tree.best_first_tree(3, draft, budget=16, topk=4) == fast
