"""The prefill's metadata and the engine's build proven by replacement (issue 21's crash-only mutants of
verify_inputs.prefill_metadata, pipeline.verify_width and graph.capture_buckets): the independent prefill metadata
(harness/check/prefill_layout.py) is the engine's on the layouts a run makes; a prefill whose metadata raises is
proven `verify inputs` by the crash rungs; and each from-start replacement (harness/check/from_start.py) lets a
build run through where the engine's own width or graph buckets are broken, the run then matching the oracle.
Each stage is planted broken in the engine under test, never in the thing checked."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness.check import prepare as prepare_mod
from harness.check.crash import PROVEN_CRASH
from harness.check.differential import check
from harness.check.localize import memory_rungs
from harness.check.from_start import REGISTRY, ladder
from harness.check.prefill_layout import independent_prefill_metadata
from harness.check.prepare import build, derive, prepare
from harness.check.records import RecordWriter
from harness.engine import graph as graph_mod
from harness.engine.attn.exact import REPLACE_STAGE_ENV
from harness.engine.ddtree import verify_inputs
from harness.engine.settings import RunSettings

SETTING = RunSettings(backend="torch", budget=8, topk=2, batch=3, max_new_tokens=8, stop_after=0)


@pytest.fixture(scope="module")
def base():
    return prepare(replace(SETTING, stop_after=1))


# -- the yardstick's own check -----------------------------------------------------------------------------------

@pytest.mark.parametrize("lens, page_size", [([7], 1), ([7], 16), ([5, 9, 3], 1), ([5, 9, 3], 16)])
def test_the_independent_prefill_metadata_is_the_engines(lens, page_size):
    """The slots as the engine's prefill takes them: one run of slots (page size 1), or each prompt on pages of
    its own (page size 16: gaps between prompts)."""
    if page_size == 1:
        loc = torch.arange(1, sum(lens) + 1)                                                    # [sum lens]
    else:
        loc = torch.cat([torch.arange(n) + page_size * (1 + 2 * b) for b, n in enumerate(lens)])  # [sum lens]
    ours, engines = independent_prefill_metadata(lens, loc), verify_inputs.prefill_metadata(lens, loc)
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "out_cache_loc"):
        a, b = getattr(ours, name), getattr(engines, name)
        assert a.dtype == b.dtype and torch.equal(a, b), (name, a, b)
    for name in ("custom_mask", "mask_indptr", "max_len_extend", "max_kv_len", "window_mask",
                 "window_mask_indptr", "prefix_mask"):
        assert getattr(ours, name) == getattr(engines, name), name


def test_the_independent_prefill_metadata_refuses_slots_that_do_not_fit_the_prompts():
    with pytest.raises(ValueError, match="5 slots for 6 prompt rows"):
        independent_prefill_metadata([2, 4], torch.arange(5))


def _raises(prompt_lens, out_cache_loc):
    raise RuntimeError("the engine's prefill metadata was called")


def test_the_cache_rebuilt_from_the_ids_does_not_lay_out_its_prefill_by_the_engines_code(base, monkeypatch):
    """rebuild_committed, the commit rung's yardstick, runs with the engine's prefill_metadata raising wherever it is
    called from (its code replaced, not a module's name for it), and writes the K/V the engine's prefill wrote."""
    p = derive(base, SETTING, pipeline=replace(base.engine.pipeline, prefill_metadata=independent_prefill_metadata))
    e = p.engine
    monkeypatch.setattr(verify_inputs.prefill_metadata, "__code__", _raises.__code__)
    e.prefill()
    r = e.requests[1]
    before = e.pool.k_buffer[0][e.req_pool.req_to_token[r.req_pool_idx, :r.seq_len]].clone()   # [n, heads, d]
    memory_rungs.rebuild_committed(e)
    after = e.pool.k_buffer[0][e.req_pool.req_to_token[r.req_pool_idx, :r.seq_len]]
    assert r.seq_len == len(r.prompt) and torch.allclose(before, after, atol=1e-5), (before - after).abs().max()


# -- the crash rung ------------------------------------------------------------------------------------------------

def _zeros_of_minus_one(prompt_lens, out_cache_loc):
    """prefill_metadata's `torch.zeros(0, ...)` -> `torch.zeros(-1, ...)` (a seed-2 mutant)."""
    return verify_inputs.AttnMetadata(
        qo_indptr=torch.zeros(len(prompt_lens) + 1, dtype=torch.int64),
        kv_indptr=torch.zeros(len(prompt_lens) + 1, dtype=torch.int64),
        kv_indices=torch.zeros(-1, dtype=torch.int64), out_cache_loc=out_cache_loc, custom_mask=None,
        mask_indptr=None, max_len_extend=max(prompt_lens))


def _kv_indptr_short(prompt_lens, out_cache_loc):
    """prefill_metadata's kv_indptr `bs + 1` -> `bs - 1` (a seed-2 mutant): the backend raises reading it."""
    meta = verify_inputs.prefill_metadata(prompt_lens, out_cache_loc)
    return replace(meta, kv_indptr=meta.kv_indptr[:-2])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("planted", [_zeros_of_minus_one, _kv_indptr_short])
def test_a_prefill_whose_metadata_raises_is_proven_verify_inputs(base, planted, page_size):
    p = derive(base, replace(SETTING, page_size=page_size),
               pipeline=replace(base.engine.pipeline, prefill_metadata=planted))
    s = check(p, RecordWriter(None))
    assert s.crash is not None and s.crash["side"] == "engine", s.crash
    assert [r["stage"] for r in s.replacements] == ["tree build", "mask", "verify inputs"], s.replacements
    assert s.replacements[-1]["correct"] and not any(r["correct"] for r in s.replacements[:-1]), s.replacements
    assert s.first.what == PROVEN_CRASH and s.first.step == 0 and s.stage == "verify inputs", s.explanation


# -- from the start ------------------------------------------------------------------------------------------------

def _float_width(budget: int):
    """verify_width's `budget + 1` -> `budget / 1` (a seed-2 mutant): the pools sized by it raise."""
    return budget / 1


def _buckets_past_the_end(max_bs: int) -> list[int]:
    """capture_buckets' `buckets[-1] * 2` -> `buckets[1] * 2` (a seed-2 mutant)."""
    buckets = [1]
    while buckets[-1] < max_bs:
        buckets.append(buckets[1] * 2)
    return buckets


def _broken_width(monkeypatch):
    base_fault = prepare_mod.apply_fault
    monkeypatch.setattr(prepare_mod, "apply_fault",
                        lambda name, s, vocab: replace(base_fault(name, s, vocab), width=_float_width))


def _broken_buckets(monkeypatch):
    monkeypatch.setattr(graph_mod, "capture_buckets", _buckets_past_the_end)


def _broken_prefill(monkeypatch):
    base_fault = prepare_mod.apply_fault
    monkeypatch.setattr(prepare_mod, "apply_fault",
                        lambda name, s, vocab: replace(base_fault(name, s, vocab), prefill_metadata=_kv_indptr_short))


def _run(s, loaded):
    """(the run's summary, None), or (None, what its build raised)."""
    try:
        p = build(s, loaded)
    except Exception as e:  # noqa: BLE001  (a build that raises is the crash these replacements prove)
        return None, e
    return check(p, RecordWriter(None), localize=False), None


@pytest.mark.parametrize("key, breaks", [("tree build", _broken_width), ("graph", _broken_buckets),
                                         ("verify inputs", _broken_prefill)])
def test_a_run_replaced_from_the_start_runs_through_where_the_engines_own_stage_breaks(base, monkeypatch, key,
                                                                                     breaks):
    s = replace(SETTING, page_size=16, cuda_graph=True)
    breaks(monkeypatch)
    broken, raised = _run(s, base.loaded)
    assert raised is not None or broken.crash is not None, "the planted stage does not break the run"
    monkeypatch.setenv(REPLACE_STAGE_ENV, key)
    summary, raised = _run(s, base.loaded)
    assert raised is None, raised
    assert summary.crash is None and summary.first is None and summary.verdict == "pass", (summary.crash,
                                                                                          summary.first)


def test_the_from_start_ladder_tries_each_replacement_where_its_code_is_in_the_crash():
    assert list(REGISTRY)[0] == "attention"
    assert ladder([("harness/engine/loop.py", "__init__"), ("harness/engine/mem/latent.py", "<listcomp>")],
                  None) == ["tree build", "KV allocation"]
    assert ladder([("harness/engine/loop.py", "prefill"), ("harness/engine/attn/bounds.py", "_indptr")],
                  None) == ["attention", "verify inputs"]
    assert ladder([("harness/engine/loop.py", "__init__"), ("harness/engine/graph.py", "capture_buckets")],
                  None) == ["tree build", "graph", "KV allocation"]
    assert ladder([("harness/engine/ddtree/verify_inputs.py", "prefill_metadata")], None) == ["verify inputs"]


def test_a_pipeline_that_lost_its_dataclass_is_replaced_on_a_copy_not_a_crash_of_ddchecks():
    """pipeline.py's `@dataclass(frozen=True)` removed (a seed-2 mutant): the from-start width still applies (the
    rerun then shows what else breaks) instead of ddcheck raising an internal error in dataclasses.replace."""
    class Undecorated:
        width = staticmethod(_float_width)
    own = Undecorated()
    s, replaced, _ = REGISTRY["tree build"].apply(SETTING, own, [[1]])
    assert s == SETTING and replaced is not own and replaced.width(8) == 9 and own.width(8) == 8.0
    _, replaced, _ = REGISTRY["verify inputs"].apply(SETTING, own, [[1]])
    assert replaced.prefill_metadata is independent_prefill_metadata
