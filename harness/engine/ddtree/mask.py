"""Stage 3a, build mask: the tree's visibility in SGLang's flat custom-mask layout.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import torch

from harness.engine.ddtree.tree import DraftTree


def kernel_visible(custom_mask: torch.Tensor) -> torch.Tensor:
    """What SGLang's extend kernels keep of a custom mask: `custom_mask != 0`
    (any dtype; a NaN is nonzero, so visible). bool, custom_mask's shape.

    The one reading of a mask every backend, audit and probe shares: a mask
    reaches the kernel with the dtype and values its producer handed over, and
    no one gives it another meaning (an additive 0 / -inf bias reads inverted)."""
    return custom_mask if custom_mask.dtype == torch.bool else custom_mask != 0


def tree_visibility(tree: DraftTree) -> torch.Tensor:
    """draft-part visibility  # [q_len, q_len] bool, True = row may attend key.

    Real row i sees its ancestors and itself: Row(i) = Row(parent(i)) + diagonal.
    Padding rows see only their own diagonal (a fully masked row divides by a
    zero softmax sum in several kernels); no real row sees a padding column.
    """
    n = tree.q_len
    vis = torch.zeros((n, n), dtype=torch.bool)
    for i in range(tree.num_rows):
        p = tree.parents[i]
        if p is not None:
            vis[i] = vis[p]
        vis[i, i] = True
    for i in range(tree.num_rows, n):
        vis[i, i] = True
    return vis


def request_mask_block(tree: DraftTree, prefix_len: int) -> torch.Tensor:
    """One request's block  # [q_len, prefix_len + q_len]; every row sees the prefix."""
    block = torch.ones((tree.q_len, prefix_len + tree.q_len), dtype=torch.bool)
    block[:, prefix_len:] = tree_visibility(tree)
    return block


def flat_custom_mask(trees: list[DraftTree], prefix_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """custom_mask  # [sum_b q_len*(prefix_b+q_len)] flat bool, per-request row-major blocks
    mask_indptr  # [bs+1] start of each request's [q_len, prefix+q_len] block"""
    return flatten_blocks([request_mask_block(t, p) for t, p in zip(trees, prefix_lens)])


def flatten_blocks(blocks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request blocks (any shape, row-major) laid end to end.
    custom_mask  # [sum_b block_b.numel()] flat
    mask_indptr  # [bs+1] start of each request's block in custom_mask"""
    sizes = torch.tensor([0] + [b.numel() for b in blocks], dtype=torch.int64)
    return torch.cat([b.reshape(-1) for b in blocks]), torch.cumsum(sizes, 0)
