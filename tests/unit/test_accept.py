"""The greedy acceptance walk (harness/engine/ddtree/accept.py) on hand-built trees."""
from __future__ import annotations

import pytest

from harness.engine.ddtree.accept import Acceptance, greedy_walk
from harness.engine.ddtree.tree import DraftTree

# chain root(10) -> 11 -> 12 -> 13, two padding rows
CHAIN = DraftTree((10, 11, 12, 13), (None, 0, 1, 2), (0, 1, 2, 3), q_len=6)
# root(10) -> {1: 20, 2: 21}; 1 -> {3: 30}; 2 -> {4: 31, 5: 32}; 5 -> {6: 40}
BRANCH = DraftTree((10, 20, 21, 30, 31, 32, 40), (None, 0, 0, 1, 2, 2, 5), (0, 1, 1, 2, 2, 2, 3), q_len=8)
X = 99  # a prediction matching no child


def test_chain_accepts_the_whole_chain_and_takes_the_bonus():
    """Every draft token matches: all rows accepted, bonus = argmax at the leaf."""
    acc = greedy_walk(CHAIN, [11, 12, 13, 77, X, X])
    assert acc.rows == (0, 1, 2, 3) and acc.bonus == 77 and acc.num_committed == 4


def test_chain_stops_at_the_first_mismatch():
    """A mismatch at depth 2 stops the walk; the bonus is the target's token there."""
    acc = greedy_walk(CHAIN, [11, 55, 13, 77, X, X])
    assert acc.rows == (0, 1) and acc.bonus == 55


def test_root_rejection_commits_only_the_root():
    """No child of the root matches: only the root is committed, bonus = root's argmax."""
    acc = greedy_walk(BRANCH, [X, 30, 32, X, X, 40, 7, X])
    assert acc.rows == (0,) and acc.bonus == X


def test_branching_follows_the_matching_sibling():
    """The walk takes the sibling the target predicts, not the first child."""
    acc = greedy_walk(BRANCH, [21, 30, 32, X, X, 40, 7, X])
    assert acc.rows == (0, 2, 5, 6) and acc.bonus == 7
    acc = greedy_walk(BRANCH, [20, 30, 32, 5, X, 40, 7, X])
    assert acc.rows == (0, 1, 3) and acc.bonus == 5
    acc = greedy_walk(BRANCH, [21, X, 31, X, 8, X, X, X])
    assert acc.rows == (0, 2, 4) and acc.bonus == 8


def test_padding_rows_are_never_reachable():
    """Predictions naming padding rows' tokens (the root's) never walk into padding."""
    pad_token = CHAIN.tokens[0]  # padding rows carry the root token
    acc = greedy_walk(CHAIN, [11, 12, 13, pad_token, pad_token, pad_token])
    assert acc.rows == (0, 1, 2, 3) and acc.bonus == pad_token
    acc = greedy_walk(CHAIN, [pad_token] * 6)
    assert acc.rows == (0,)
    for predicts in ([11, 12, 13, 10, 11, 12], [20, 30, 31, 40, 10, 10, 10, 10]):
        tree = CHAIN if len(predicts) == 6 else BRANCH
        assert all(r < tree.num_rows for r in greedy_walk(tree, predicts).rows)


def test_acceptance_must_start_at_the_root():
    """An Acceptance without the root row first is rejected on construction."""
    with pytest.raises(ValueError):
        Acceptance((), 1)
    with pytest.raises(ValueError):
        Acceptance((1, 2), 1)
