"""The weakest mask bugs: one key gained or lost by one row. Plain mask
stages (Pipeline.build_mask), not catalog faults: they measure how small a
leak a verdict still sees (benchmarks/noise_floor_study.py, the noise-floor
tests), which is what a tolerance must be judged by.

Layer: faults. Imports the engine and below; never ports, check, report, workflows or cli."""
from __future__ import annotations

from typing import Callable

import torch

from harness.engine.ddtree.mask import flatten_blocks, request_mask_block
from harness.engine.ddtree.tree import DraftTree


def _edit_blocks(edit: Callable[[torch.Tensor, DraftTree, int], None]):
    """A mask stage: SGLang's blocks, then `edit(block, tree, prefix_len)` on each."""
    def build(trees: list[DraftTree], prefix_lens: list[int]):
        blocks = []
        for t, p in zip(trees, prefix_lens):
            block = request_mask_block(t, p)  # [q_len, p + q_len] bool
            edit(block, t, p)
            blocks.append(block)
        return flatten_blocks(blocks)
    return build


def _last_row_sees_one_padding(block: torch.Tensor, t: DraftTree, p: int) -> None:
    if t.num_padding:
        block[t.num_rows - 1, p + t.num_rows] = True


def _one_sibling_visible(block: torch.Tensor, t: DraftTree, p: int) -> None:
    pairs = [(i, j) for i in range(1, t.num_rows) for j in range(1, i) if t.parents[i] == t.parents[j]]
    if pairs:
        i, j = pairs[-1]
        block[i, p + j] = True


def _one_ancestor_hidden(block: torch.Tensor, t: DraftTree, p: int) -> None:
    deep = [i for i in range(t.num_rows) if t.depths[i] >= 2]
    if deep:
        i = deep[-1]
        block[i, p + t.parents[i]] = False


ONE_KEY_LEAKS = {
    "last-row-sees-one-padding": _edit_blocks(_last_row_sees_one_padding),
    "one-sibling-visible": _edit_blocks(_one_sibling_visible),
    "one-ancestor-hidden": _edit_blocks(_one_ancestor_hidden),
}
