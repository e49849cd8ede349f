"""SGLang's own attention backend as the system under test (sglang-serving,
sglang-serving-dflash): the engine hands TritonAttnBackend whole verify batches
with a verify input, SGLang builds the metadata itself and attends through
RadixAttention; under --cuda-graph SGLang's own graph state replays at a bucket
above the batch. Skipped where SGLang's serving import chain is not installed
(the Makefile's SGLANG_SERVING packages)."""
from __future__ import annotations

import pytest
import torch

from harness.check.differential import check
from harness.check.localize.graph_audit import audit_graph
from harness.check.prepare import derive, prepare
from harness.check.records import RecordWriter
from harness.engine.attn.base import BackendUnavailable, ServerBatch
from harness.engine.serving_graph import ServingGraphRunner, serving_buckets
from harness.engine.settings import RunSettings, UsageError

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module", autouse=True)
def _serving_path():
    from harness.engine.attn.sglang_runtime import import_serving
    try:
        import_serving()
    except BackendUnavailable as e:
        pytest.skip(f"SGLang's serving path is not installed here: {e}")


def _check(**kw):
    p = prepare(RunSettings(**kw))
    return p, check(p, RecordWriter(None))


def test_the_seed_setting_passes_eager():
    # ddcheck run --backend sglang-serving --budget 16 --topk 1 --no-cuda-graph (the tiny preset)
    p, s = _check(backend="sglang-serving", budget=16, topk=1, cuda_graph=False)
    assert s.passed and s.nodes_checked > 0, s.explanation
    assert s.max_rel_err < 1e-4
    assert p.engine.graph is None and p.engine.serving is not None


def test_the_seed_setting_passes_under_sglangs_graph_state_at_a_bucket_above_the_batch():
    p, s = _check(backend="sglang-serving", budget=16, topk=1, cuda_graph=True)
    assert s.passed and s.nodes_checked > 0, s.explanation
    graph = p.engine.graph
    assert isinstance(graph, ServingGraphRunner) and graph.num_captures == 1
    assert graph.last.bucket == 2 > graph.last.live.seq_lens.numel()     # one batch-padding request replayed
    # the replay read SGLang's graph buffers: kv_indptr padded with the fill value's one key
    kvp = graph.last.meta.kv_indptr.tolist()
    assert kvp[2] - kvp[1] == p.engine.serving.seq_len_fill_value()


def test_sglangs_graph_buffers_agree_with_the_eager_batch_and_its_padding_rule():
    p = prepare(RunSettings(backend="sglang-serving", budget=8, topk=2, batch=3, cuda_graph=True, max_new_tokens=4))
    for result in p.engine.rounds():
        replay = p.engine.graph.last
        assert replay.bucket > replay.live.seq_lens.numel() and not replay.dummy_mask_refilled
        # every static buffer SGLang refilled agrees with the eager batch and the padding rule (seq_len 1,
        # request row 0, slot 0, position 0); the dummies' mask blocks are SGLang's to leave as they are
        assert audit_graph(replay, p.engine.req_pool.req_to_token.cpu(), result.step) == []


def test_the_seed_leak_is_caught_and_named():
    _, s = _check(backend="sglang-serving", budget=16, topk=1, max_new_tokens=6, fault="padded-kv-visible")
    assert not s.passed and s.fault_class == "padding-leak", s.explanation


def test_the_metadata_the_kernel_read_is_the_one_sglang_built_from_the_verify_input():
    p = prepare(RunSettings(backend="sglang-serving", budget=8, topk=2, batch=2, max_new_tokens=2))
    result = next(p.engine.rounds())
    own = result.batch.attn                      # ddcheck's own layout of the same batch (DOMAIN.md section 3)
    sglang = p.engine.serving.attn          # SGLang's TritonAttnBackend
    m = sglang.forward_metadata
    assert type(m).__module__.startswith("sglang.")
    assert m.kv_indptr.tolist() == own.kv_indptr.tolist()
    assert m.kv_indices.tolist() == own.kv_indices.tolist()       # from SGLang's req_to_token at seq_lens
    assert m.qo_indptr.tolist() == own.qo_indptr.tolist()
    assert m.mask_indptr.tolist() == own.mask_indptr.tolist()
    assert torch.equal(m.custom_mask.bool(), own.custom_mask.bool())   # the verify input's mask, as handed over
    # the KV canary checks the reads SGLang's kernel made: its very kv_indices
    assert p.engine.served_meta.kv_indices.data_ptr() == m.kv_indices.data_ptr()
    table = sglang.req_to_token                  # SGLang's own table (int32), copied from the scheduler's
    assert table.dtype == torch.int32 and table is not p.engine.req_pool.req_to_token


def test_the_prefill_is_an_extend_sglang_lays_out_itself():
    p = prepare(RunSettings(backend="sglang-serving", batch=2, max_new_tokens=2))
    p.engine.prefill()
    m = p.engine.serving.attn.forward_metadata
    lens = [len(r.prompt) for r in p.engine.requests]
    assert m.qo_indptr.tolist() == [0, lens[0], lens[0] + lens[1]]   # causal extend of each whole prompt
    assert m.custom_mask is None and m.kv_indices.numel() == 0        # no cached prefix, no tree


def test_each_engine_on_one_backend_has_its_own_session_over_its_own_pool():
    p = prepare(RunSettings(backend="sglang-serving", budget=4, max_new_tokens=2))
    q = derive(p)                                   # the localizer's fresh engine over the same backend
    assert q.engine.kernel is p.engine.kernel and q.engine.serving is not p.engine.serving
    for prepared in (p, q):
        sglang_pool = prepared.engine.serving.runner.token_to_kv_pool
        assert sglang_pool.get_key_buffer(0) is prepared.engine.pool.k_buffer[0]
        assert sglang_pool.get_value_buffer(1) is prepared.engine.pool.v_buffer[1]


def test_dflash_verify_keeps_the_tree_eager_and_loses_it_under_sglangs_graph_capture():
    # SGLang 0.5.23 captures the DFlash verify on TritonAttnBackend with no custom mask (issue 26)
    _, eager = _check(backend="sglang-serving-dflash", budget=16, topk=2, max_new_tokens=6)
    assert eager.passed, eager.explanation
    _, graph = _check(backend="sglang-serving-dflash", budget=16, topk=2, max_new_tokens=6, cuda_graph=True)
    assert not graph.passed and graph.fault_class == "graph-causal-mask", graph.explanation


def test_a_fault_of_ddcheck_s_own_graph_runner_is_refused():
    with pytest.raises(UsageError, match="replays SGLang.s own graph state"):
        prepare(RunSettings(backend="sglang-serving", cuda_graph=True, fault="stale-graph-mask"))


def test_buckets_lie_above_every_batch():
    assert serving_buckets(1) == [2] and serving_buckets(2) == serving_buckets(3) == [2, 4]
    assert all(any(b > bs for b in serving_buckets(bs)) for bs in range(1, 9))


def test_a_server_batch_holds_together():
    ids = torch.zeros(6, dtype=torch.int64)
    with pytest.raises(ValueError, match="rows"):
        ServerBatch("target-verify", ids, ids, torch.tensor([0, 1]), torch.tensor([3, 4]), (3, 3), ids[:5])
    with pytest.raises(ValueError, match="one width"):
        ServerBatch("target-verify", ids, ids, torch.tensor([0, 1]), torch.tensor([3, 4]), (2, 4), ids)
    with pytest.raises(ValueError, match="extend or a target-verify"):
        ServerBatch("decode", ids, ids, torch.tensor([0, 1]), torch.tensor([3, 4]), (3, 3), ids)
