"""Target-verify metadata in SGLang's layout (harness/engine/ddtree/verify_inputs.py)."""
from __future__ import annotations

import pytest
import torch

from harness.engine.ddtree.mask import flat_custom_mask
from harness.engine.ddtree.tree import DraftTree
from harness.engine.ddtree.verify_inputs import build_verify_batch, padding_row_inputs

Q_LEN = 6
# root(10) -> {1: 20, 2: 21}; 1 -> {3: 30}; two padding rows
BRANCH = DraftTree((10, 20, 21, 30), (None, 0, 0, 1), (0, 1, 1, 2), q_len=Q_LEN)
CHAIN = DraftTree((40, 41, 42, 43, 44), (None, 0, 1, 2, 3), (0, 1, 2, 3, 4), q_len=Q_LEN)  # one padding row
SEQ_LENS = [5, 3]
REQ_POOL = [2, 0]


def make_batch(mask_builder=flat_custom_mask):
    req_to_token = torch.zeros((3, 16), dtype=torch.int64)
    req_to_token[2, :5] = torch.tensor([11, 12, 13, 14, 15])
    req_to_token[0, :3] = torch.tensor([21, 22, 23])
    req_to_token[0, 3:] = 99  # past the prefix: must not leak into kv_indices
    out_cache_loc = torch.arange(100, 100 + 2 * Q_LEN)
    vb = build_verify_batch([BRANCH, CHAIN], SEQ_LENS, REQ_POOL, req_to_token, out_cache_loc, mask_builder)
    return vb, out_cache_loc


def test_input_ids_root_nodes_then_padding():
    """input_ids: each request's root, nodes in row order, then padding rows."""
    vb, _ = make_batch()
    pad0, _ = padding_row_inputs(BRANCH, SEQ_LENS[0])
    pad1, _ = padding_row_inputs(CHAIN, SEQ_LENS[1])
    assert vb.input_ids.tolist() == [10, 20, 21, 30, pad0, pad0, 40, 41, 42, 43, 44, pad1]
    assert vb.input_ids.shape == (2 * Q_LEN,) and vb.q_len == Q_LEN


def test_positions_are_prefix_plus_depth():
    """positions = prefix + depth; siblings share a position; padding rows sit at the root's."""
    vb, _ = make_batch()
    assert vb.positions.tolist() == [5, 6, 6, 7, 5, 5, 3, 4, 5, 6, 7, 3]
    assert padding_row_inputs(BRANCH, 5) == (10, 5)  # the root's token and position


def test_indptrs_stride_and_prefixes():
    """qo_indptr strides by q_len; kv_indptr = cumsum(prefix); kv_indices = req_to_token prefixes."""
    vb, _ = make_batch()
    a = vb.attn
    assert a.qo_indptr.tolist() == [0, Q_LEN, 2 * Q_LEN]
    assert a.kv_indptr.tolist() == [0, 5, 8]
    assert a.kv_indices.tolist() == [11, 12, 13, 14, 15, 21, 22, 23]
    assert a.kv_indices.dtype == torch.int64
    assert a.max_len_extend == Q_LEN and a.batch_size == 2
    assert vb.seq_lens.tolist() == SEQ_LENS and vb.req_pool_indices.tolist() == REQ_POOL


def test_out_cache_loc_passes_through():
    """out_cache_loc is the caller's freshly allocated slots, unchanged."""
    vb, loc = make_batch()
    assert vb.attn.out_cache_loc is loc or torch.equal(vb.attn.out_cache_loc, loc)


def test_mask_comes_from_the_mask_builder():
    """The custom mask and mask_indptr are the mask stage's, for these trees and prefixes."""
    vb, _ = make_batch()
    mask, indptr = flat_custom_mask([BRANCH, CHAIN], SEQ_LENS)
    assert torch.equal(vb.attn.custom_mask, mask) and torch.equal(vb.attn.mask_indptr, indptr)
    seen = []
    make_batch(lambda trees, prefixes: seen.append(list(prefixes)) or flat_custom_mask(trees, prefixes))
    assert seen == [SEQ_LENS]


def test_trees_of_different_width_are_rejected():
    """Every request of a verify batch has the same q_len."""
    other = DraftTree((1, 2), (None, 0), (0, 1), q_len=Q_LEN + 1)
    with pytest.raises(ValueError):
        build_verify_batch([BRANCH, other], [1, 1], [0, 1], torch.zeros((2, 4), dtype=torch.int64),
                           torch.arange(1, 2 * Q_LEN + 2))
