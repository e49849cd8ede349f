"""SGLang's second extend kernel (extend_attention_fwd_unified) on the same
verify batches: fault-free settings pass, its unified index list is each
request's prefix slots then its rows' slots, and a mask bug in the prefix
columns is told apart from the draft part by which SGLang kernel disagrees
(sglang-triton skips the prefix columns, the unified kernel reads them)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness.engine.attn import make_backend
from harness.check.differential import check
from harness.check.prepare import derive, prepare
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings
from test_sglang_mask_regions import block_first_prefix_key

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize("kw", [dict(budget=8, topk=2, batch=2, cuda_graph=False),
                                dict(budget=16, topk=1, batch=3, cuda_graph=True)])
def test_fault_free_settings_pass_on_the_unified_kernel(kw):
    s = check(prepare(RunSettings(backend="sglang-unified", max_new_tokens=6, **kw)), RecordWriter(None))
    assert s.passed and s.nodes_checked > 0 and s.padding_rows >= 0, s.explanation
    assert s.max_rel_err < 1e-4


def test_the_unified_index_list_is_each_prefix_then_its_rows():
    backend = make_backend("sglang-unified", "cpu", torch.float32)
    p = prepare(RunSettings(backend="sglang-unified", budget=4, topk=2, batch=2, max_new_tokens=2))
    result = next(p.engine.rounds())
    meta = result.batch.attn
    indptr, indices, prefix_lens = backend.unified_indices(meta)
    kvp, qo = meta.kv_indptr.tolist(), meta.qo_indptr.tolist()
    want, lens = [], []
    for b in range(meta.batch_size):
        want += meta.kv_indices[kvp[b]:kvp[b + 1]].tolist() + meta.out_cache_loc[qo[b]:qo[b + 1]].tolist()
        lens.append(kvp[b + 1] - kvp[b])
    assert indices.tolist()[:len(want)] == want and int(indptr[-1]) == len(want)
    assert prefix_lens.tolist() == lens


def _run(backend: str, **loc):
    p = prepare(RunSettings(budget=4, topk=2, backend=backend, batch=2, max_new_tokens=4))
    p = derive(p, pipeline=replace(p.engine.pipeline, build_mask=block_first_prefix_key))
    return check(p, RecordWriter(None), **loc)


def test_a_prefix_column_bug_shows_on_the_kernel_that_reads_it_only():
    assert _run("sglang-triton", localize=False).passed      # skip_prefix_custom_mask: the column is never read
    s = _run("sglang-unified")
    assert not s.passed and s.divergent_nodes > 0
    assert (s.stage, s.quantity) == ("mask", "custom_mask"), s.explanation
    assert "lost prefix key" in s.explanation, s.explanation


def test_the_seed_leak_is_named_on_the_unified_kernel_too():
    # the probes save the rows' K/V in the pool, where this kernel reads them
    s = check(prepare(RunSettings(backend="sglang-unified", budget=16, topk=1, max_new_tokens=4,
                                  fault="padded-kv-visible")), RecordWriter(None))
    assert not s.passed and s.fault_class == "padding-leak", s.explanation
