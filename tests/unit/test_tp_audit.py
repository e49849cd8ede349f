"""The ranks' agreement audit (harness/engine/tp/audit.py): each TP fault's per-rank stage, run as the
ranks run it, leaves metadata the audit names by the fault's class, and agreeing ranks give no finding."""
from __future__ import annotations

import torch

from harness.engine.ddtree.tree import build_tree
from harness.engine.ddtree.verify_inputs import build_verify_batch
from harness.engine.pipeline import Pipeline
from harness.engine.tp.audit import RANK_CLASSES, RankMeta, audit_kv_heads, audit_ranks
from harness.engine.tp.sharding import kv_heads_of_rank, kv_heads_read, shard_plan
from harness.engine.model.presets import PRESETS
from harness.faults.registry import catalog

VOCAB, BUDGET = 32, 8


def _round(pipeline: Pipeline, prefix: int, seed: int) -> RankMeta:
    """One request's verify metadata for a round at `prefix` committed tokens, built by `pipeline`'s stage."""
    logprobs = torch.log_softmax(torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(seed)), -1)
    tree = build_tree(1, logprobs, BUDGET, 1)          # a chain of 4 and 4 padding rows
    req_to_token = torch.arange(64).reshape(1, 64) + 1
    loc = torch.arange(tree.q_len) + 40
    return RankMeta.of(pipeline.build_verify_batch([tree], [prefix], [0], req_to_token, loc, pipeline.build_mask))


def _ranks(fault: str, tp: int = 2) -> list[list[RankMeta]]:
    """Two rounds (prefix 10, then 14) on each rank: [round][rank]."""
    p = catalog()[fault].apply(Pipeline())
    per_rank = [p.rank_stages(p, r, tp) for r in range(tp)]
    return [[_round(pr, prefix, step) for pr in per_rank] for step, prefix in enumerate((10, 14))]


def test_agreeing_ranks_have_no_finding():
    metas = [_round(Pipeline(), 10, 0), _round(Pipeline(), 10, 0)]
    assert audit_ranks(0, metas, None) == []


def test_a_rank_on_the_previous_rounds_mask_is_named_stale():
    rounds = _ranks("tp-stale-mask")
    assert audit_ranks(0, rounds[0], None) == []          # nothing stale before a second round
    found = audit_ranks(1, rounds[1], rounds[0])
    assert [(f.rank, f.cls, f.quantity) for f in found] == [(1, "rank-stale-mask", "custom_mask")]
    assert "previous round" in found[0].text


def test_a_mask_no_rank_built_before_is_not_called_stale():
    rounds = _ranks("tp-stale-mask")
    other = RankMeta(~rounds[1][0].custom_mask, *(getattr(rounds[1][0], q) for q in ("kv_indices", "positions",
                                                                                   "out_cache_loc")))
    found = audit_ranks(1, [rounds[1][0], other], rounds[0])
    assert [f.cls for f in found] == ["rank-mask"]


def test_a_rank_with_shifted_kv_indices_is_named_with_its_shift():
    rounds = _ranks("tp-shifted-kv-indices", tp=4)
    found = audit_ranks(0, rounds[0], None)
    assert [(f.rank, f.cls) for f in found] == [(3, "rank-kv-indices")]   # the last rank only
    assert "shifted by +1" in found[0].text


def test_the_odd_rank_is_named_even_when_it_is_rank_0():
    """Three ranks agree, rank 0 does not: rank 0 is named, against the majority's metadata."""
    rounds = _ranks("tp-shifted-kv-indices", tp=4)[0]   # rank 3 shifted
    found = audit_ranks(0, [rounds[3], rounds[1], rounds[2], rounds[0]], None)
    assert [(f.rank, f.cls) for f in found] == [(0, "rank-kv-indices")] and "rank 1's" in found[0].text


def test_positions_and_out_cache_loc_are_compared_too():
    a = _round(Pipeline(), 10, 0)
    b = RankMeta(a.custom_mask, a.kv_indices, a.positions + 1, a.out_cache_loc.flip(0))
    assert [f.cls for f in audit_ranks(2, [a, b], None)] == ["rank-positions", "rank-out-cache-loc"]


def test_kv_heads_sharded_where_they_must_be_replicated_is_named():
    cfg = PRESETS["tiny"]   # 4 query heads over 2 KV heads, on 4 ranks
    layout = catalog()["tp-kv-heads-sharded"].apply(Pipeline()).kv_head_layout
    plans = [shard_plan(cfg, r, 4, layout) for r in range(4)]
    found = [f for p in plans if (f := audit_kv_heads(p.rank, p.q_heads, p.kv_heads,
                                                      kv_heads_read(cfg, p.q_heads))) is not None]
    assert [(f.rank, f.cls) for f in found] == [(1, "kv-heads-sharded"), (2, "kv-heads-sharded")]
    right = [shard_plan(cfg, r, 4, kv_heads_of_rank) for r in range(4)]
    assert all(audit_kv_heads(p.rank, p.q_heads, p.kv_heads, kv_heads_read(cfg, p.q_heads)) is None for p in right)


def test_each_tp_fault_expects_a_class_the_audit_names():
    tp_faults = [f for f in catalog().values() if f.name.startswith("tp-")]
    assert {f.expected_class for f in tp_faults} == {"rank-stale-mask", "rank-kv-indices", "kv-heads-sharded"}
    assert all(f.expected_class in RANK_CLASSES for f in tp_faults)
