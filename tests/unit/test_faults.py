"""The fault catalog: every class of DOMAIN.md section 4 is there, each with
its lines, each refuses settings where it cannot show (exit 2 in the CLI),
and each broken stage breaks what its line says."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from harness.faults import apply_fault
from harness.faults.registry import catalog, why_cannot_show
from harness.faults import catalog as cat_mod
from harness.engine.settings import RunSettings, UsageError
from harness.engine.ddtree.mask import flat_custom_mask, request_mask_block
from harness.engine.ddtree.tree import DraftTree

NAMES = {"padded-kv-visible", "mask-row-stride", "padded-rectangle-mask", "short-graph-mask",
         "graph-captured-causal", "stale-graph-mask", "stale-kv-indices", "no-kv-compaction",
         "padded-row-fully-masked", "child-before-parent", "position-from-index", "padding-slot-alias",
         "bonus-from-wrong-node", "position-base-offset", "stale-graph-positions", "mask-request-permutation",
         "bonus-stride-cross-request", "duplicate-sibling-token", "commit-past-stop", "padded-entry-live",
         "stale-graph-scalar", "accept-topology-mismatch", "mla-rope-flat-index", "mla-latent-wrong-slot",
         "moe-router-reads-padding"}
VOCAB = 128
CHAIN = DraftTree((5, 6, 7), (None, 0, 1), (0, 1, 2), q_len=5)         # 2 nodes + root, 2 padding rows
BRANCH = DraftTree((5, 6, 7, 8), (None, 0, 0, 1), (0, 1, 1, 2), q_len=4)


def test_catalog_has_every_class_with_distinct_names_and_lines():
    cat = catalog()
    assert NAMES <= set(cat)
    assert len({f.expected_class for f in cat.values()}) == len(cat)  # the localizer can tell each apart
    for f in cat.values():
        assert f.breaks and f.shows_when and "\n" not in f.breaks + f.shows_when
        assert isinstance(f.source, str) and len(f.source) <= 40
    assert cat["padded-kv-visible"].source == "seed"


@pytest.mark.parametrize("name,bad,good", [
    ("stale-graph-mask", {}, {"cuda_graph": True}),
    ("stale-kv-indices", {"cuda_graph": True, "max_new_tokens": 9}, {"cuda_graph": True, "max_new_tokens": 10}),
    ("graph-captured-causal", {"cuda_graph": True, "topk": 1}, {"cuda_graph": True, "topk": 2}),
    ("short-graph-mask", {"cuda_graph": True, "batch": 4, "backend": "torch"},
     {"cuda_graph": True, "batch": 3, "backend": "torch"}),
    ("padded-rectangle-mask", {"batch": 1}, {"batch": 2}),
    ("padded-kv-visible", {"budget": 7}, {"budget": 8}),          # topk 1, L 7: 7 nodes fill budget 7
    ("position-from-index", {"topk": 2, "budget": 7}, {"topk": 2, "budget": 8}),
    ("no-kv-compaction", {"topk": 1}, {"topk": 2}),
    ("padded-row-fully-masked", {"budget": 7, "backend": "torch"}, {"backend": "torch"}),
    ("bonus-from-wrong-node", {"accept": "sglang"}, {"accept": "walk"}),
    ("stale-graph-positions", {"cuda_graph": True, "max_new_tokens": 9}, {"cuda_graph": True, "max_new_tokens": 10}),
    ("mask-request-permutation", {"batch": 2, "topk": 1}, {"batch": 2, "topk": 2}),
    ("mask-request-permutation", {"batch": 1, "topk": 2}, {"batch": 2, "topk": 2}),
    ("bonus-stride-cross-request", {"batch": 1}, {"batch": 2}),
    ("bonus-stride-cross-request", {"batch": 2, "budget": 7}, {"batch": 2, "budget": 8}),  # no padding: packed = padded
    ("duplicate-sibling-token", {"topk": 1}, {"topk": 2}),
    ("commit-past-stop", {}, {"eos_id": 3}),
    ("padded-entry-live", {"cuda_graph": True, "batch": 4}, {"cuda_graph": True, "batch": 3}),
    ("padded-entry-live", {"batch": 3}, {"cuda_graph": True, "batch": 3}),
    ("stale-graph-scalar", {"cuda_graph": True, "max_new_tokens": 9}, {"cuda_graph": True, "max_new_tokens": 10}),
    ("stale-graph-scalar", {}, {"cuda_graph": True}),
    ("accept-topology-mismatch", {"topk": 1}, {"topk": 2}),
    ("accept-topology-mismatch", {"topk": 2, "accept": "sglang"}, {"topk": 2, "accept": "walk"}),
    ("mla-rope-flat-index", {"topk": 2}, {"topk": 2, "model": "tiny-deepseek-v3"}),
    ("mla-rope-flat-index", {"model": "tiny-deepseek-v3"}, {"topk": 2, "model": "tiny-deepseek-v3"}),
    ("mla-latent-wrong-slot", {"model": "tiny-deepseek-v3", "max_new_tokens": 9}, {"model": "tiny-deepseek-v3"}),
    ("moe-router-reads-padding", {}, {"model": "tiny-deepseek-v3"}),
    ("moe-router-reads-padding", {"model": "tiny-deepseek-v3", "budget": 7}, {"model": "tiny-kimi-k2"}),
])
def test_can_show_is_exact_about_the_settings_it_needs(name, bad, good):
    base = RunSettings(backend="torch")
    assert why_cannot_show(name, replace(base, **bad), VOCAB) is not None
    assert why_cannot_show(name, replace(base, **good), VOCAB) is None


def test_fully_masked_rows_cannot_show_on_a_kernel_that_always_sees_the_prefix():
    pytest.importorskip("sglang")
    from harness.engine.attn.sglang_triton import available
    if not available():
        pytest.skip("SGLang's kernel does not import")
    for name in ("padded-row-fully-masked", "short-graph-mask"):
        s = RunSettings(backend="sglang-triton", cuda_graph=True, batch=3)
        assert "prefix columns" in why_cannot_show(name, s, VOCAB)
    assert "max_kv_len" in why_cannot_show("stale-graph-scalar", RunSettings(backend="sglang-triton", cuda_graph=True),
                                           VOCAB)   # the kernel takes no prefix bound


def test_apply_fault_names_the_needed_settings():
    with pytest.raises(UsageError, match="--cuda-graph"):
        apply_fault("stale-graph-mask", RunSettings(), VOCAB)
    with pytest.raises(UsageError, match="unknown fault"):
        apply_fault("no-such-fault", RunSettings(), VOCAB)


def test_cli_lists_the_catalog_and_refuses_a_fault_that_cannot_show():
    from harness.cli import _register, app
    _register()
    out = CliRunner().invoke(app, ["faults"], env={"COLUMNS": "250"})
    assert out.exit_code == 0
    for name in NAMES:
        assert name in out.output
    assert "source" in out.output and "SGLang #6309" in out.output and "seed" in out.output
    out = CliRunner().invoke(app, ["run", "--backend", "torch", "--no-cuda-graph", "--fault", "stale-kv-indices"])
    assert out.exit_code == 2
    assert "--cuda-graph" in out.output


def test_padding_visible_mask_opens_only_padding_columns():
    good, _ = flat_custom_mask([CHAIN], [4])
    bad, _ = cat_mod._mask_padding_visible([CHAIN], [4])
    diff = (bad & ~good).view(5, 9).nonzero().tolist()
    assert diff and all(r < 3 and c >= 4 + 3 for r, c in diff)


def test_row_stride_mask_shifts_every_row_after_the_first():
    bad, indptr = cat_mod._mask_row_stride([CHAIN], [4])
    assert indptr.tolist() == [0, 5 * 9]                       # the kernel's block size
    read = bad.view(5, 9)                                      # read at prefix + q_len
    want = request_mask_block(CHAIN, 4)
    assert torch.equal(read[0, :7], want[0, :7]) and not torch.equal(read[1], want[1])


def test_rectangle_mask_is_right_only_for_the_longest_prefix():
    mask, indptr = cat_mod._mask_rectangle([CHAIN, CHAIN], [6, 3])
    assert indptr.tolist() == [0, 5 * 11, 2 * 5 * 11]
    assert torch.equal(mask[:5 * 11].view(5, 11), request_mask_block(CHAIN, 6))
    start = int(indptr[1])
    assert not torch.equal(mask[start:start + 5 * 8].view(5, 8), request_mask_block(CHAIN, 3))


def test_empty_padding_rows_see_nothing():
    mask, _ = cat_mod._mask_padding_rows_empty([CHAIN], [4])
    block = mask.view(5, 9)
    assert not block[3:].any() and block[:3].any(-1).all()


def _batch(edit, tree=BRANCH, prefix=3):
    req_to_token = torch.arange(1, 41).view(2, 20)
    loc = torch.arange(100, 100 + tree.q_len)
    stage = cat_mod._inputs_then(edit)
    return stage([tree], [prefix], [0], req_to_token, loc, flat_custom_mask), loc


def test_relabel_puts_children_before_parents_consistently():
    vb, _ = _batch(cat_mod._relabel_reversed)
    assert vb.input_ids.tolist() == [5, 8, 7, 6]               # rows 1..3 reversed
    assert vb.positions.tolist() == [3, 5, 4, 4]
    block = vb.attn.custom_mask.view(4, 7)[:, 3:]
    assert block[1].tolist() == [True, True, False, True]       # node 3 (now row 1) sees its parent at row 3


def test_positions_from_index_and_padding_alias():
    vb, _ = _batch(cat_mod._positions_from_index)
    assert vb.positions.tolist() == [3, 4, 5, 6]                # depths are 0, 1, 1, 2
    vb, loc = _batch(cat_mod._padding_slots_alias, tree=CHAIN)
    assert vb.attn.out_cache_loc.tolist() == [100, 101, 102, 101, 102]
    assert loc.tolist() == [100, 101, 102, 103, 104]            # the engine's own slots are untouched


def test_contiguous_commit_and_root_bonus():
    from harness.engine.mem.allocator import SlotAllocator
    from harness.engine.mem.pool import ReqToTokenPool
    from harness.engine.ddtree.accept import Acceptance
    alloc, pool = SlotAllocator(20), ReqToTokenPool(1, 10, "cpu")
    slots = alloc.alloc(4)
    n = cat_mod._commit_contiguous(pool, alloc, 0, 2, slots, Acceptance((0, 2), 9))
    assert n == 4 and pool.req_to_token[0, 2:4].tolist() == slots[:2].tolist()   # not slots[[0, 2]]
    acc = cat_mod._bonus_from_root(BRANCH, [6, 8, 1, 2])
    assert acc.rows == (0, 1, 3) and acc.bonus == 6             # the walk ends at row 3, whose argmax is 2


def test_acceptance_audit_names_the_root_bonus():
    """The localizer's audit re-walks the logits with greedy_walk: the root-bonus stage's
    acceptance is flagged as a wrong bonus, the walk's own acceptance passes."""
    from types import SimpleNamespace

    from harness.check.localize.audits import audit_acceptance
    from harness.engine.ddtree.accept import greedy_walk
    predicts = [6, 8, 1, 2]                                     # walk: 0 -> 1 -> 3, bonus 2
    logits = torch.nn.functional.one_hot(torch.tensor(predicts), VOCAB).float()  # [q_len, vocab]

    def step(acceptance):
        return SimpleNamespace(step=3, rid=1, tree=BRANCH, logits=logits, acceptance=acceptance)
    assert audit_acceptance(step(greedy_walk(BRANCH, predicts))) is None
    found = audit_acceptance(step(cat_mod._bonus_from_root(BRANCH, predicts)))
    assert found.kind == "wrong-bonus" and "bonus token 6 is the argmax of row 0" in found.text
    assert "last accepted row 3 (token 2)" in found.text
    found = audit_acceptance(step(greedy_walk(BRANCH, [6, 1, 1, 2])))  # stops at the root
    assert found.kind == "accept-rows" and "the greedy walk accepts [0, 1, 3]" in found.text


# two depth-1 nodes (rows 1, 2), each with a child of token 7 (rows 3, 4): cousins repeating a token
COUSINS = DraftTree((5, 6, 8, 7, 7), (None, 0, 0, 1, 2), (0, 1, 1, 2, 2), q_len=6)


def test_level_map_acceptance_is_shadowed_by_a_cousin_with_the_same_token():
    from harness.engine.ddtree.accept import greedy_walk
    from harness.check.localize.audits import audit_acceptance
    from types import SimpleNamespace
    predicts = [6, 7, 1, 2, 3, 4]                                # walk: 0 -> 1 -> 3, bonus 2
    assert greedy_walk(COUSINS, predicts).rows == (0, 1, 3)
    acc = cat_mod._accept_level_map(COUSINS, predicts)
    assert acc.rows == (0, 1) and acc.bonus == 7                  # row 4 (parent 2) shadows row 3
    assert cat_mod._accept_level_map(BRANCH, [6, 8, 1, 2]) == greedy_walk(BRANCH, [6, 8, 1, 2])  # no repeats: right
    logits = torch.nn.functional.one_hot(torch.tensor(predicts), VOCAB).float()
    found = audit_acceptance(SimpleNamespace(step=0, rid=0, tree=COUSINS, logits=logits, acceptance=acc))
    assert found.kind == "token-shadowed" and "row 4 (parent 2) repeats that token" in found.text


def test_packed_bonus_offset_reads_another_requests_rows():
    from types import SimpleNamespace
    from harness.engine.ddtree.accept import Acceptance
    from harness.check.localize.audits import audit_batch_bonus
    trees = [CHAIN, CHAIN]                                        # 3 real rows of q_len 5 each
    flat = [10, 11, 12, 13, 14, 20, 21, 22, 23, 24]               # argmax per flat row
    acc = Acceptance((0, 1), 22)                                  # request 1 ends at its row 1: bonus 21 ...
    assert cat_mod._bonus_at_packed_offset(flat, 1, 5, trees, acc) == 14   # ... read at 3 + 1, request 0's row 4
    assert cat_mod._bonus_at_packed_offset(flat, 0, 5, trees, acc) == 11   # request 0: packed = padded

    def rs(b, bonus):
        logits = torch.nn.functional.one_hot(torch.tensor(flat[b * 5:(b + 1) * 5]), VOCAB).float()
        return SimpleNamespace(step=2, rid=b, tree=CHAIN, logits=logits, acceptance=Acceptance((0, 1), bonus))
    assert audit_batch_bonus(SimpleNamespace(requests=(rs(0, 11), rs(1, 21)))) is None
    found = audit_batch_bonus(SimpleNamespace(requests=(rs(0, 11), rs(1, 14))))
    assert found.kind == "bonus-cross-request" and "flat row 4 (request 0, row 4)" in found.text


def test_other_requests_tree_mask_and_shifted_positions():
    branch = replace(BRANCH, q_len=6)
    mask, indptr = cat_mod._mask_other_requests_tree([branch, COUSINS], [3, 2])
    assert indptr.tolist() == [0, 6 * 9, 6 * 9 + 6 * 8]            # sized and placed per request ...
    assert torch.equal(mask[:6 * 9].view(6, 9), request_mask_block(COUSINS, 3))   # ... filled with the other tree
    assert torch.equal(mask[6 * 9:].view(6, 8), request_mask_block(branch, 2))
    vb, _ = _batch(cat_mod._positions_shifted)
    assert vb.positions.tolist() == [4, 5, 5, 6]                  # prefix 3 + depths 0, 1, 1, 2, all + 1


def test_stop_ignored_commits_past_the_eos_and_the_audit_says_so():
    from types import SimpleNamespace
    from harness.engine.ddtree.accept import Acceptance
    from harness.check.localize.audits import audit_stop
    chain = DraftTree((5, 6, 7, 8), (None, 0, 1, 2), (0, 1, 2, 3), q_len=5)
    acc = Acceptance((0, 1, 2, 3), 9)
    assert cat_mod._stop_ignored(chain, acc, 7) == acc
    found = audit_stop(SimpleNamespace(step=1, rid=0, tree=chain, acceptance=acc), 7)
    assert found.kind == "past-stop" and "rows [2, 3] and the bonus 9" in found.text
    assert audit_stop(SimpleNamespace(step=1, rid=0, tree=chain, acceptance=Acceptance((0, 1), 7)), 7) is None


# pop order 0, 1 (depth 1), 2 (depth 2, under 1), 3 (depth 1): depth order is 0, 1, 3, 2
DEEP_FIRST = DraftTree((5, 6, 7, 8), (None, 0, 1, 0), (0, 1, 2, 1), q_len=5)


def test_depth_order_parents_walk_another_tree_and_the_audit_says_so():
    from types import SimpleNamespace
    from harness.engine.ddtree.accept import greedy_walk
    from harness.check.localize.audits import audit_acceptance
    predicts = [6, 8, 1, 2, 3]                       # the verified tree: row 1's only child is row 2 (token 7)
    assert greedy_walk(DEEP_FIRST, predicts).rows == (0, 1)
    acc = cat_mod._accept_on_depth_order(DEEP_FIRST, predicts)
    assert acc.rows == (0, 1, 3) and acc.bonus == 2   # in depth order row 3 is row 1's child
    assert cat_mod._accept_on_depth_order(BRANCH, [6, 8, 1, 2]) == greedy_walk(BRANCH, [6, 8, 1, 2])  # same orders
    logits = torch.nn.functional.one_hot(torch.tensor(predicts), VOCAB).float()
    found = audit_acceptance(SimpleNamespace(step=2, rid=0, tree=DEEP_FIRST, logits=logits, acceptance=acc))
    assert found.kind == "topology" and "row 3's parent is row 0, not the previously accepted row 1" in found.text


# rows 2 and 4 both carry token 7 at depth 2 (parents 1 and 3); in depth order row 3 comes before row 2
TWINS_DEEP_FIRST = DraftTree((5, 6, 7, 8, 7), (None, 0, 1, 0, 3), (0, 1, 2, 1, 2), q_len=6)


def test_an_acceptance_two_mechanisms_explain_is_ambiguous_until_a_later_round_names_one():
    """Both the depth-order walk and the token-keyed walk stop at row 1 here: the
    audit names neither; the localizer keeps the first finding that names one."""
    from types import SimpleNamespace
    from harness.engine.ddtree.accept import greedy_walk
    from harness.check.localize.audits import Finding, audit_acceptance
    from harness.check.localize.driver import _first_named
    predicts = [6, 7, 1, 2, 3, 4]
    assert greedy_walk(TWINS_DEEP_FIRST, predicts).rows == (0, 1, 2)
    acc = cat_mod._accept_on_depth_order(TWINS_DEEP_FIRST, predicts)
    assert acc == cat_mod._accept_level_map(TWINS_DEEP_FIRST, predicts) and acc.rows == (0, 1)
    logits = torch.nn.functional.one_hot(torch.tensor(predicts), VOCAB).float()
    found = audit_acceptance(SimpleNamespace(step=0, rid=0, tree=TWINS_DEEP_FIRST, logits=logits, acceptance=acc))
    assert found.kind == "accept-ambiguous" and "both give them" in found.text
    named = Finding("topology", "later")
    assert _first_named(found, Finding("accept-rows", "x")) is found
    assert _first_named(found, named) is named and _first_named(named, found) is named
    assert _first_named(None, found) is found


def test_the_localizer_reads_on_past_an_ambiguous_acceptance():
    """Seed 2: the first wrong acceptance fits both walks; a later round's fits only the depth-order one."""
    from harness.check.differential import check
    from harness.check.prepare import prepare
    from harness.check.records import RecordWriter
    s = RunSettings(backend="torch", topk=2, seed=2, max_new_tokens=24, fault="accept-topology-mismatch")
    summary = check(prepare(s), RecordWriter(None))
    assert summary.fault_class == "accept-topology-mismatch", summary.explanation
