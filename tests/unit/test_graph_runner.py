"""The graph runner on CPU (harness/engine/graph.py): buckets, batch padding
with dummy requests, one capture per bucket, logits equal to eager."""
from __future__ import annotations

import pytest
import torch

from harness.check.prepare import prepare
from harness.engine.mem.allocator import PADDING_SLOT
from harness.engine.graph import GraphRunner, capture_buckets
from harness.engine.settings import RunSettings
from harness.engine.ddtree.tree import DraftTree, build_tree
from harness.engine.ddtree.verify_inputs import build_verify_batch

MAX_BS = 4


@pytest.fixture
def engine():
    """An eager engine of 4 requests after prefill (prompts of different lengths)."""
    s = RunSettings(budget=8, topk=2, batch=MAX_BS, max_new_tokens=8, backend="torch", cuda_graph=False)
    e = prepare(s).engine
    e.prefill()
    return e


def make_runner(engine) -> GraphRunner:
    return GraphRunner(engine._verify_forward, engine.s.q_len, MAX_BS, engine.max_context,
                       engine.req_pool.req_to_token, "cpu")


def live_batch(engine, rids: list[int], step: int = 0):
    """A verify batch for these requests, on freshly allocated slots."""
    s, reqs = engine.s, [engine.requests[i] for i in rids]
    trees = [build_tree(r.emitted[-1], engine.drafter.propose_along(r.continuation, len(r.emitted), r.spec.accuracy,
                                                              r.rid, step), s.budget, s.topk) for r in reqs]
    loc = engine.pool.allocator.alloc(len(reqs) * s.q_len)
    return build_verify_batch(trees, [r.seq_len for r in reqs], [r.req_pool_idx for r in reqs],
                              engine.req_pool.req_to_token, loc)


def eager(engine, vb) -> torch.Tensor:
    return engine._verify_forward(vb.input_ids, vb.positions, vb.attn)


@pytest.mark.parametrize("max_bs", range(1, 18))
def test_buckets_cover_every_batch_size(max_bs):
    """Buckets are 1, 2, 4, ... up to the first power of two that holds max_bs
    (none past it), and the runner replays a batch of bs in the smallest of them
    that holds it (a stub forward: only the bucket choice is judged)."""
    b = capture_buckets(max_bs)
    assert b == [2 ** i for i in range(len(b))]
    assert b[-1] >= max_bs and (len(b) == 1 or b[-2] < max_bs)
    tree = DraftTree((5, 6), (None, 0), (0, 1), q_len=2)
    req_to_token = torch.arange(max_bs * 4).view(max_bs, 4)
    runner = GraphRunner(lambda ids, pos, meta: torch.zeros(ids.numel(), 3), 2, max_bs, 4, req_to_token, "cpu")
    for bs in range(1, max_bs + 1):
        vb = build_verify_batch([tree] * bs, [1] * bs, list(range(bs)), req_to_token, torch.arange(bs * 2) + 100)
        runner.verify(vb)
        smallest = 1 << (bs - 1).bit_length()  # the smallest power of two >= bs
        assert runner.last.bucket == smallest, f"bs {bs} ran in bucket {runner.last.bucket}"


def test_batch_runs_in_the_smallest_bucket_that_holds_it(engine):
    """bs 3 with buckets [1, 2, 4] is captured and replayed in bucket 4."""
    runner = make_runner(engine)
    assert runner.buckets[:3] == [1, 2, 4]
    runner.verify(live_batch(engine, [0, 1, 2]))
    assert set(runner._graphs) == {4}
    runner.verify(live_batch(engine, [1]))
    assert set(runner._graphs) == {1, 4}


def test_dummy_requests_pad_the_bucket(engine):
    """Padding a bs-3 batch to bucket 4 adds a dummy request: seq_len 1, request 0's first slot, writes to PADDING_SLOT."""
    runner = make_runner(engine)
    n = engine.s.q_len
    runner.verify(live_batch(engine, [0, 1, 2, 3]))  # fill the bucket's buffers with a full batch first
    vb = live_batch(engine, [0, 1, 2], step=1)
    runner.verify(vb)
    st = runner._graphs[4]
    live = 3 * n
    assert torch.equal(st.input_ids[:live], vb.input_ids) and torch.equal(st.positions[:live], vb.positions)
    assert (st.out_cache_loc[live:] == PADDING_SLOT).all(), "dummy rows write to the padding slot"
    assert torch.equal(st.out_cache_loc[:live], vb.attn.out_cache_loc)
    assert (st.input_ids[live:] == 0).all() and (st.positions[live:] == 0).all()
    seq = torch.diff(st.kv_indptr).tolist()
    assert seq == vb.seq_lens.tolist() + [1], "dummy request has seq_len 1"
    dummy_start = int(st.kv_indptr[3])
    assert int(st.kv_indices[dummy_start]) == int(engine.req_pool.req_to_token[0, 0]), "dummy reads request 0"
    assert torch.equal(st.kv_indices[:dummy_start], vb.attn.kv_indices)
    sizes = torch.diff(st.mask_indptr).tolist()
    assert sizes == [n * (p + n) for p in seq]
    assert st.custom_mask[int(st.mask_indptr[3]):int(st.mask_indptr[4])].all(), "dummy rows are never empty"


def test_live_padding_entries_repeat_the_last_request(engine):
    """With dummy_padding_entries off (the padded-entry-live fault), the dummy
    of a bs-3 batch in bucket 4 repeats request 2's entry: its seq_len, prefix
    slots, positions and verify slots, so its K/V writes land in request 2's slots."""
    from dataclasses import replace
    runner = make_runner(engine)
    runner.options = replace(runner.options, dummy_padding_entries=False)
    n = engine.s.q_len
    vb = live_batch(engine, [0, 1, 2])
    runner.verify(vb)
    st, live = runner._graphs[4], 3 * n
    assert torch.equal(st.out_cache_loc[live:], vb.attn.out_cache_loc[live - n:])
    assert torch.equal(st.positions[live:], vb.positions[live - n:])
    assert (st.input_ids[live:] == 0).all()                       # the dummy's own tokens
    assert torch.diff(st.kv_indptr).tolist() == vb.seq_lens.tolist() + [int(vb.seq_lens[2])]
    start = int(st.kv_indptr[3])
    assert torch.equal(st.kv_indices[start:int(st.kv_indptr[4])], vb.attn.kv_indices[int(vb.attn.kv_indptr[2]):])


@pytest.mark.parametrize("at_capacity", [True, False])
def test_the_captured_max_kv_len_bounds_later_replays(engine, at_capacity):
    """The graph freezes the max_kv_len scalar at capture: SGLang-style at the
    buffers' capacity (max_context), every later prefix read whole; frozen at the
    capturing batch's longest prefix (the stale-graph-scalar fault), a later,
    longer prefix loses its tail keys, and the replay audit says which."""
    from dataclasses import replace
    from harness.check.localize.graph_audit import audit_graph
    runner = make_runner(engine)
    runner.options = replace(runner.options, max_kv_len_at_capacity=at_capacity)
    by_len = sorted(engine.requests, key=lambda r: r.seq_len)
    short, long = by_len[0], by_len[-1]
    assert short.seq_len < long.seq_len
    runner.verify(live_batch(engine, [short.rid]))
    vb = live_batch(engine, [long.rid], step=1)
    got, want = runner.verify(vb), eager(engine, vb)
    meta = runner._graphs[1].meta
    wrong = [w for w in audit_graph(runner.last, engine.req_pool.req_to_token, 1) if w.quantity == "max_kv_len"]
    if at_capacity:
        assert meta.max_kv_len == engine.max_context and not wrong
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert meta.max_kv_len == short.seq_len and wrong[0].hint == "stale-scalar"
        assert (wrong[0].expected, wrong[0].found) == (long.seq_len, short.seq_len)
        assert not torch.allclose(got, want, rtol=1e-3, atol=1e-3)


def test_one_capture_per_bucket_reused_across_replays(engine):
    """A bucket is captured once; later batches of that bucket replay it."""
    runner = make_runner(engine)
    for step, rids in enumerate([[0, 1, 2], [0, 1, 2, 3], [0, 1, 2], [2], [3], [0, 1]]):
        runner.verify(live_batch(engine, rids, step))
    assert runner.num_captures == 3 and set(runner._graphs) == {1, 2, 4}


@pytest.mark.parametrize("rids_seq", [[[0, 1, 2]], [[0, 1, 2, 3], [0, 1, 2]], [[0, 1, 2, 3], [3]], [[1, 2, 3], [0, 2]]])
def test_replay_logits_equal_eager(engine, rids_seq):
    """Batches smaller than their bucket (and after a larger batch) give eager's logits."""
    runner = make_runner(engine)
    for step, rids in enumerate(rids_seq):
        vb = live_batch(engine, rids, step)
        got = runner.verify(vb)
        want = eager(engine, vb)
        assert got.shape == want.shape == (len(rids) * engine.s.q_len, engine.cfg.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
