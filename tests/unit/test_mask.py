"""The tree's visibility in SGLang's flat custom-mask layout (harness/engine/ddtree/mask.py)."""
from __future__ import annotations

import pytest
import torch

from harness.engine.ddtree.mask import flat_custom_mask, flatten_blocks, request_mask_block, tree_visibility
from harness.engine.ddtree.tree import DraftTree, build_tree

# root 0 -> {1, 2}; 1 -> {3, 4}; 3 -> {5}; 2 rows of padding (q_len 8)
BRANCHY = DraftTree((10, 11, 12, 13, 14, 15), (None, 0, 0, 1, 1, 3), (0, 1, 1, 2, 2, 3), q_len=8)
CHAIN = DraftTree((3, 4, 5), (None, 0, 1), (0, 1, 2), q_len=8)
FULL = DraftTree((3, 4, 5, 6), (None, 0, 0, 2), (0, 1, 1, 2), q_len=4)


def built_tree(seed: int, budget: int = 12) -> DraftTree:
    gen = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(4, 6, generator=gen), -1)  # [L, vocab]
    return build_tree(1, lp, budget=budget, topk=2)


TREES = [BRANCHY, CHAIN, FULL, built_tree(0), built_tree(1)]


@pytest.mark.parametrize("tree", TREES)
def test_visibility_is_the_ancestor_closure(tree):
    """A real row sees exactly its root-to-row path; nothing else."""
    vis = tree_visibility(tree)
    assert vis.shape == (tree.q_len, tree.q_len) and vis.dtype == torch.bool
    for i in range(tree.num_rows):
        expected = torch.zeros(tree.q_len, dtype=torch.bool)
        expected[tree.ancestors(i)] = True
        assert torch.equal(vis[i], expected), f"row {i}"


@pytest.mark.parametrize("tree", TREES)
def test_padding_rows_see_only_themselves(tree):
    """Padding rows see their own diagonal only in the draft part (no empty row)."""
    vis = tree_visibility(tree)
    for i in range(tree.num_rows, tree.q_len):
        assert vis[i].nonzero().flatten().tolist() == [i]


@pytest.mark.parametrize("tree", TREES)
def test_real_rows_never_see_padding_columns(tree):
    """No real row attends a padding row's K/V."""
    vis = tree_visibility(tree)
    assert not vis[:tree.num_rows, tree.num_rows:].any()


def test_every_row_sees_the_whole_prefix():
    """The committed prefix is visible to every verify row, padding included."""
    block = request_mask_block(BRANCHY, prefix_len=5)
    assert block.shape == (8, 5 + 8)
    assert block[:, :5].all()
    assert torch.equal(block[:, 5:], tree_visibility(BRANCHY))


def test_flat_layout_for_a_batch_of_different_prefixes():
    """mask_indptr = cumsum(q_len*(prefix+q_len)); each block is row-major with row stride prefix+q_len."""
    trees = [BRANCHY, CHAIN, built_tree(2, budget=7)]  # all q_len 8
    prefixes = [3, 11, 1]
    flat, indptr = flat_custom_mask(trees, prefixes)
    q_len = 8
    sizes = [q_len * (p + q_len) for p in prefixes]
    assert indptr.tolist() == [0, sizes[0], sizes[0] + sizes[1], sum(sizes)]
    assert flat.dtype == torch.bool and flat.numel() == sum(sizes)
    for b, (tree, prefix) in enumerate(zip(trees, prefixes)):
        stride = prefix + q_len
        block = flat[indptr[b]:indptr[b + 1]]
        vis = tree_visibility(tree)
        for row in range(q_len):
            line = block[row * stride:(row + 1) * stride]
            assert line[:prefix].all()
            assert torch.equal(line[prefix:], vis[row]), f"request {b} row {row}"


def test_flatten_blocks_lays_blocks_end_to_end():
    """flatten_blocks (shared by the mask stage and the fault catalog): each block row-major, indptr its starts."""
    blocks = [torch.arange(6).view(2, 3) % 2 == 0, torch.tensor([True]), torch.zeros(2, 2, dtype=torch.bool)]
    flat, indptr = flatten_blocks(blocks)
    assert indptr.dtype == torch.int64 and indptr.tolist() == [0, 6, 7, 11]
    assert flat.tolist() == [True, False, True, False, True, False] + [True] + [False] * 4
