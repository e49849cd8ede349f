"""SGLang's verify_tree_greedy_triton behind the acceptance stage: the links
built from DDTree parents, agreement with the greedy walk on hand-built
trees, and the engine's every-step cross-check turning a disagreement into an
`accept` record."""
from __future__ import annotations

import random

import pytest
import torch

from harness.check.differential import check

from harness.check.prepare import prepare
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings
from harness.engine.ddtree import accept_sglang
from harness.engine.ddtree.accept import greedy_walk
from harness.engine.ddtree.accept_sglang import TreeLinks, build_links, sglang_accept, sglang_accept_batch
from harness.engine.ddtree.tree import DraftTree

pytestmark = pytest.mark.sglang

# root 0 (token 9) -> rows 1 (5), 2 (6), 3 (4); 1 -> 4 (7), 5 (3); 2 -> 6 (8); 4 -> 7 (2); two padding rows
WIDE = DraftTree((9, 5, 6, 4, 7, 3, 8, 2), (None, 0, 0, 0, 1, 1, 2, 4), (0, 1, 1, 1, 2, 2, 2, 3), q_len=10)
CHAIN = DraftTree((1, 2, 3, 4, 5), (None, 0, 1, 2, 3), (0, 1, 2, 3, 4), q_len=5)
ROOT_ONLY = DraftTree((7,), (None,), (0,), q_len=4)


def test_links_are_first_child_and_next_sibling_with_padding_all_minus_one():
    links = build_links(WIDE, batch_offset=20)
    assert links.index == (20, 21, 22, 23, 24, 25, 26, 27, -1, -1)
    assert links.next_token == (1, 4, 6, -1, 7, -1, -1, -1, -1, -1)
    assert links.next_sibling == (-1, 2, 3, -1, 5, -1, -1, -1, -1, -1)


def _predicts(tree: DraftTree, rng: random.Random) -> list[int]:
    """Mostly a child's token (so walks go deep), sometimes anything."""
    out = []
    for row in range(tree.q_len):
        kids = tree.children(row) if row < tree.num_rows else []
        out.append(tree.tokens[rng.choice(kids)] if kids and rng.random() < 0.8 else rng.randrange(12))
    return out


@pytest.mark.parametrize("tree", [WIDE, CHAIN, ROOT_ONLY], ids=["wide", "chain", "root-only"])
def test_sglang_kernel_and_walk_agree_on_hand_built_trees(tree):
    rng = random.Random(0)
    depths_seen = set()
    for _ in range(40):
        pred = _predicts(tree, rng)
        walk = greedy_walk(tree, pred)
        assert sglang_accept(tree, pred) == walk
        depths_seen.add(len(walk.rows))
    assert max(depths_seen) == max(tree.depths) + 1  # the deepest path was exercised


def test_batched_call_offsets_each_request():
    rng = random.Random(1)
    trees = [WIDE, WIDE, WIDE]
    preds = [_predicts(t, rng) for t in trees]
    got = sglang_accept_batch(trees, torch.tensor(preds))
    assert got == [greedy_walk(t, p) for t, p in zip(trees, preds)]


def drop_siblings(tree: DraftTree, batch_offset: int = 0) -> TreeLinks:
    """A broken link builder: only the first child of each row is ever tried."""
    links = build_links(tree, batch_offset)
    return TreeLinks(links.index, links.next_token, (-1,) * len(links.next_sibling))


def test_broken_links_disagree_with_the_walk():
    pred = [6, 0, 8, 0, 0, 0, 0, 0, 0, 0]  # root -> row 2 (second child) -> row 6
    assert greedy_walk(WIDE, pred).rows == (0, 2, 6)
    assert sglang_accept_batch([WIDE], torch.tensor([pred]), drop_siblings)[0].rows == (0,)


@pytest.mark.parametrize("accept", ["walk", "sglang"])
def test_engine_cross_check_passes_when_both_agree(accept):
    s = RunSettings(budget=8, topk=2, backend="torch", batch=2, max_new_tokens=8, accept=accept)
    writer = RecordWriter(None)
    summary = check(prepare(s), writer)
    assert summary.passed and summary.accept_mismatches == 0
    assert not [line for line in writer.lines if '"kind": "accept"' in line]


def _run_with_broken_links(monkeypatch):
    """A wide-tree run whose SGLang link builder drops siblings; the walk drives it."""
    monkeypatch.setattr(accept_sglang, "build_links", drop_siblings)
    s = RunSettings(budget=16, topk=4, backend="torch", batch=2, max_new_tokens=16, accept="walk")
    writer = RecordWriter(None)
    summary = check(prepare(s), writer)
    return summary, [__import__("json").loads(line) for line in writer.lines]


def test_broken_link_builder_is_caught_as_an_accept_record(monkeypatch):
    summary, records = _run_with_broken_links(monkeypatch)
    accepts = [r for r in records if r["kind"] == "accept"]
    assert accepts and summary.accept_mismatches == len(accepts)
    assert not summary.passed and records[-1]["kind"] == "summary" and records[-1]["passed"] is False
    a = accepts[0]
    assert a["verdict"] == "diverge" and a["walk_rows"] != a["sglang_rows"]
    assert set(a) >= {"step", "request", "walk_rows", "sglang_rows", "walk_bonus", "sglang_bonus", "setting"}
    assert any("disagree" in n for n in summary.notes)


def test_accept_only_divergence_is_first_and_localized(monkeypatch):
    """A run that diverges only in acceptance names that step as its first divergence and localizes it."""
    summary, records = _run_with_broken_links(monkeypatch)
    first_accept = next(r for r in records if r["kind"] == "accept")
    assert summary.first is not None and summary.first.what == "accept"
    assert (summary.first.step, summary.first.request) == (first_accept["step"], first_accept["request"])
    assert summary.fault_class == "accept-mismatch" and "disagree" in summary.explanation
    assert any(r["kind"] == "localize" and r["fault_class"] == "accept-mismatch" for r in records)
