"""sglang-eagle: SGLang's own EAGLE builder fed ddcheck's DDTree in EAGLE's
candidate-lineage encoding builds the same mask, positions and walk."""
from __future__ import annotations

import pytest
import torch

from harness.ports.mask_reading import kernel_mask
from harness.engine.ddtree.accept import greedy_walk
from harness.engine.ddtree.mask import request_mask_block
from harness.engine.ddtree.tree import build_tree

pytestmark = pytest.mark.sglang
eagle = pytest.importorskip("harness.ports.families.sglang_eagle")


@pytest.fixture(scope="module")
def port():
    try:
        return eagle.SGLangEagle()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"SGLang's spec_tree does not import: {e}")


def _trees(seed: int, topk: int, budget: int):
    g = torch.Generator().manual_seed(seed)
    return [eagle.eagle_order(build_tree(3 + b, torch.log_softmax(torch.randn(7, 40, generator=g), -1), budget, topk))
            for b in range(2)]


@pytest.mark.parametrize("seed, topk, budget", [(0, 2, 8), (1, 4, 16), (2, 3, 12)])
def test_sglang_builder_matches_the_tree(port, seed, topk, budget):
    trees, prefixes = _trees(seed, topk, budget), [5, 9]
    c = port.compile(trees, prefixes)
    km = kernel_mask(c.mask, trees[0].q_len, prefixes)
    want = torch.cat([request_mask_block(t, p).reshape(-1) for t, p in zip(trees, prefixes)])
    assert torch.equal(km.custom_mask, want)
    assert c.positions.tolist() == [p + d for t, p in zip(trees, prefixes) for d in t.depths]


def test_eagle_order_sorts_by_candidate_index_and_keeps_parents_first():
    for tree in _trees(3, 4, 16):
        sel, _, _ = eagle.eagle_encoding(tree)
        assert sel == sorted(sel)
        assert all(p < i for i, p in enumerate(tree.parents) if p is not None)


def test_sglang_walk_over_its_links_is_the_greedy_walk(port):
    trees = _trees(4, 2, 8)
    g = torch.Generator().manual_seed(9)
    for _ in range(5):
        # argmax per row: mostly a child's token, so the walk goes deep
        predicts = torch.stack([torch.tensor([t.tokens[t.children(i)[0]] if t.children(i) and torch.rand(1, generator=g) < 0.8
                                              else 99 for i in range(t.q_len)]) for t in trees])
        got = port.accept(trees, predicts)
        assert got == [greedy_walk(t, p.tolist()) for t, p in zip(trees, predicts)]
