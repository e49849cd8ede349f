"""The note on prefix keys a backend never reads counts them from the
metadata the kernel reads, and never raises on a batch whose seq_lens
disagree with its mask (an internal error, exit 3, on the seq-lens-plus-one
mutant under SGLang's kernel; issue 21 point 7)."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch

from harness.check.differential import _ignored_prefix_keys
from harness.engine.ddtree.tree import DraftTree
from harness.engine.ddtree.verify_inputs import build_verify_batch

DRAFT_ONLY = SimpleNamespace(mask_regions=frozenset({"draft"}))


def _batch():
    tree = DraftTree(tokens=(1, 2, 3), parents=(None, 0, 0), depths=(0, 1, 1), q_len=3)
    r2t = torch.arange(40).reshape(2, 20)
    vb = build_verify_batch([tree, tree], [4, 6], [0, 1], r2t, torch.arange(30, 36))
    mask = vb.attn.custom_mask.clone()
    mask[int(vb.attn.mask_indptr[1]) + 2] = False   # request 1, row 0 blocks prefix key 2
    return replace(vb, attn=replace(vb.attn, custom_mask=mask))


def test_a_blocked_prefix_key_is_counted():
    assert _ignored_prefix_keys(_batch(), DRAFT_ONLY) == 1


def test_seq_lens_that_disagree_with_the_mask_do_not_raise():
    vb = _batch()
    vb = replace(vb, seq_lens=vb.seq_lens + 1)   # what the kernel reads (kv_indptr, the mask) is unchanged
    assert _ignored_prefix_keys(vb, DRAFT_ONLY) == 1
