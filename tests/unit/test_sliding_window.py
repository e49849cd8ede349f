"""Sliding-window attention as an axis: config.json read on both sides, the
oracle's window by absolute position, the engine's window by each row's
position (prefix + depth) on the torch backend and SGLang's kernel, the two
window faults caught and named, and what stays refused."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import harness.cli as cli
from ddschema import ModelConfig
from harness.check.differential import check
from harness.check.prepare import prepare
from harness.engine.model.hf_config import config_from_hf, config_to_hf
from harness.engine.model.presets import PRESETS, random_weights
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings, UsageError
from reference.checkpoint import read_config
from reference.model import DenseLlama, causal_mask
from tests.unit.test_checkpoint import BASE

cli._register()

ONE_LAYER = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=16)


# -- the oracle ------------------------------------------------------------------------

def test_the_oracle_windows_by_absolute_position_as_computed_by_hand():
    """W = 2 over 4 tokens: each query sees itself and the token before, nothing older."""
    windowed = ModelConfig(**{**ONE_LAYER.__dict__, "sliding_window": 2, "sliding_layers": (0,)})
    weights = random_weights(ONE_LAYER, 3)
    by_hand = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    tokens = [5, 9, 2, 7]
    got = DenseLlama(windowed, weights).forward(tokens).logits                     # [4, V]
    want = DenseLlama(ONE_LAYER, weights).forward(tokens, visible=by_hand).logits  # [4, V]
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    full = DenseLlama(ONE_LAYER, weights).forward(tokens, visible=causal_mask(4)).logits
    assert not torch.allclose(got[2:], full[2:], atol=1e-6)   # the window changes rows past it


def test_the_oracle_window_is_exact_over_a_cached_prefix():
    """Positions P.. after a cached past are absolute: the prefix cache stays exact under a window."""
    cfg = PRESETS["tiny-swa"]
    model = DenseLlama(cfg, random_weights(cfg, 0))
    tokens = list(range(3, 23))
    whole = model.forward(tokens).logits                                     # [20, V]
    head = model.forward(tokens[:13])
    tail = model.forward(tokens[13:], past=(head.ks, head.vs)).logits        # [7, V]
    assert torch.allclose(whole[13:], tail, rtol=0, atol=1e-12)


# -- config.json on both sides ----------------------------------------------------------

CONFIGS = {
    "mistral": ({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 6}, (6, (0, 1))),
    "qwen2 max_window_layers": ({**BASE, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                                 "sliding_window": 5, "max_window_layers": 1}, (5, (1,))),
    "qwen3 alternating layer_types": ({**BASE, "architectures": ["Qwen3ForCausalLM"], "sliding_window": 4,
                                       "layer_types": ["sliding_attention", "full_attention"]}, (4, (0,))),
    "mistral window null": ({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": None}, (None, ())),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_both_sides_read_the_window_and_its_layers_alike(name):
    hf, (window, layers) = CONFIGS[name]
    engine, oracle = config_from_hf(hf), read_config(hf)
    assert (engine.sliding_window, engine.sliding_layers) == (window, layers)
    assert engine == oracle


@pytest.mark.parametrize("preset", ["tiny-swa", "tiny-qwen2-swa-alt"])
def test_windowed_presets_round_trip_through_config_json(preset):
    hf = json.loads(json.dumps(config_to_hf(PRESETS[preset])))
    assert config_from_hf(hf) == read_config(hf) == PRESETS[preset]


# -- the engine against the oracle -------------------------------------------------------

def run(**kw):
    s = RunSettings(max_new_tokens=kw.pop("max_new_tokens", 10), **kw)
    return check(prepare(s), RecordWriter(None))


@pytest.mark.parametrize("topk", [1, 2])
def test_torch_backend_with_a_window_matches_the_oracle(topk):
    summary = run(backend="torch", topk=topk, sliding_window=8)
    assert summary.passed and summary.nodes_checked > 0


def test_alternating_preset_matches_the_oracle():
    summary = run(model="tiny-qwen2-swa-alt", backend="torch", topk=2, batch=2, max_new_tokens=8)
    assert summary.passed


@pytest.mark.sglang
@pytest.mark.parametrize("backend, topk", [("sglang-triton", 1), ("sglang-triton", 2), ("sglang-unified", 2)])
def test_sglang_kernels_with_a_window_match_the_oracle(backend, topk):
    summary = run(backend=backend, topk=topk, budget=8, sliding_window=8, max_new_tokens=6)
    assert summary.passed and summary.nodes_checked > 0


@pytest.mark.sglang
def test_the_kernels_own_window_argument_bounds_rows_by_flat_index_not_depth():
    """The experiment behind the design: SGLang's extend kernel with its own
    sliding_window_size windows a row by prefix + row index (SGLang PR #39287), so
    a sibling at depth 1 in row 2 loses a key its position keeps; the window
    folded into the mask (prefix columns read) is the oracle's rule."""
    from harness.engine.attn import make_backend
    from harness.engine.ddtree.verify_inputs import AttnMetadata
    from harness.engine.ddtree.window import with_window
    torch.manual_seed(0)
    p, n, window = 12, 5, 6
    depths = torch.tensor([0, 1, 1, 2, 2])
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)                                                    # parents 0, 0, 1, 2
    mask = torch.cat([torch.ones(n, p, dtype=torch.bool), tree], 1).reshape(-1)               # [n*(p+n)]
    meta = AttnMetadata(qo_indptr=torch.tensor([0, n]), kv_indptr=torch.tensor([0, p]),
                        kv_indices=torch.arange(1, p + 1), out_cache_loc=torch.arange(p + 1, p + n + 1),
                        custom_mask=mask, mask_indptr=torch.tensor([0, n * (p + n)]), max_len_extend=n)
    q = torch.randn(n, 2, 16)
    kb, vb = torch.randn(p + n + 1, 1, 16), torch.randn(p + n + 1, 1, 16)
    k, v = kb[p + 1:], vb[p + 1:]
    folded = with_window(meta, p + depths, window).windowed()
    sglang, plain = make_backend("sglang-triton", "cpu", torch.float32), make_backend("torch", "cpu", torch.float32)
    want = plain.forward(q, k, v, 0, kb, vb, folded)
    assert torch.allclose(sglang.forward(q, k, v, 0, kb, vb, folded), want, atol=1e-5)
    own = torch.empty_like(q)
    sglang._fwd(q, k.contiguous(), v.contiguous(), own, kb, vb, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                mask, False, meta.mask_indptr, n, 1.0, 1.0, sm_scale=0.25, sliding_window_size=window - 1,
                window_kv_offsets=torch.zeros(1, dtype=torch.int32))   # the whole prefix: offset 0
    same = [bool(torch.allclose(own[i], want[i], atol=1e-5)) for i in range(n)]
    assert same[:2] == [True, True] and not same[2]   # row 2 (depth 1): the flat index moves its window


# -- under CUDA-graph replay ---------------------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", pytest.param("sglang-triton", marks=pytest.mark.sglang)])
def test_a_window_under_graph_replay_matches_the_oracle_and_eager(backend):
    """The sliding layers' mask is a static buffer of the graph, refilled before each
    replay: batch 3 runs in bucket 4 (a dummy request), topk 2 branches near the edge."""
    kw = dict(backend=backend, topk=2, budget=8, batch=3, sliding_window=8, max_new_tokens=8)
    graph = prepare(RunSettings(cuda_graph=True, **kw))
    summary = check(graph, RecordWriter(None))
    assert summary.passed and summary.nodes_checked > 0 and graph.engine.graph.num_captures >= 1
    eager = [rs.logits for r in prepare(RunSettings(**kw)).engine.rounds() for rs in r.requests]
    replayed = [rs.logits for r in prepare(RunSettings(cuda_graph=True, **kw)).engine.rounds() for rs in r.requests]
    assert len(eager) == len(replayed) > 3
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(eager, replayed))


def test_a_stale_window_buffer_is_named_by_the_graph_audit():
    from dataclasses import replace as dc_replace
    from harness.check.localize.graph_audit import audit_graph
    from harness.engine.graph import GraphOptions
    p = prepare(RunSettings(backend="torch", cuda_graph=True, topk=2, budget=8, sliding_window=8, max_new_tokens=12))
    p.engine.graph.options = dc_replace(p.engine.graph.options, refill_mask=False)
    found = []
    for result in p.engine.rounds():
        found += [w.quantity for w in audit_graph(p.engine.graph.last, p.engine.req_pool.req_to_token, result.step)]
    assert "window_mask" in found and isinstance(p.engine.graph.options, GraphOptions)


# -- faults --------------------------------------------------------------------------

@pytest.mark.parametrize("fault, extra", [("swa-window-by-row-index", {"topk": 2}), ("swa-window-ignored", {})])
def test_window_faults_are_caught_and_named(fault, extra):
    summary = run(backend="torch", sliding_window=8, fault=fault, **extra)
    assert not summary.passed
    assert summary.fault_class == {"swa-window-by-row-index": "swa-window-row-index"}.get(fault, fault)
    assert summary.quantity == "window_mask"
    assert ("row index" if "row-index" in fault else "no window") in summary.explanation


def test_a_window_fault_without_a_window_is_a_usage_error():
    with pytest.raises(UsageError, match="cannot show"):
        prepare(RunSettings(backend="torch", fault="swa-window-ignored"))


# -- refusals ----------------------------------------------------------------------------

@pytest.mark.parametrize("args", [["--sliding-window", "0"], ["--sliding-window", "-3"]])
def test_unsupported_window_combinations_are_one_line_exit_2(tmp_path, args):
    out = tmp_path / "run.jsonl"
    result = CliRunner().invoke(cli.app, ["run", "--backend", "torch", "--out", str(out), *args])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddcheck: error:")
    assert not out.exists()


def test_the_window_is_in_the_reproduce_command_and_a_case_axis(tmp_path):
    from harness.workflows.cases import load_case
    assert "--sliding-window 8" in RunSettings(sliding_window=8).command()
    case = tmp_path / "c.toml"
    case.write_text('name = "w"\n[[matrix]]\nsliding_window = [0, 8]\n')
    assert [s.sliding_window for s in load_case(case).settings()] == [None, 8]


# -- with the other axes -------------------------------------------------------------

@pytest.mark.parametrize("extra", [{"page_size": 16}, {"page_size": 16, "cuda_graph": True, "batch": 3},
                                   {"page_size": 4, "batch": 2}])
def test_a_window_with_paged_kv_and_graph_replay_matches_the_oracle(extra):
    summary = run(backend="torch", topk=2, budget=8, sliding_window=8, max_new_tokens=12, **extra)
    assert summary.passed and summary.nodes_checked > 20


@pytest.mark.parametrize("fault", ["swa-window-by-row-index", "swa-window-ignored"])
def test_window_faults_are_named_under_graph_replay_with_paged_kv(fault):
    summary = run(backend="torch", topk=2, budget=8, batch=3, sliding_window=8, max_new_tokens=12, page_size=16,
                  cuda_graph=True, fault=fault)
    assert not summary.passed and summary.quantity == "window_mask"
    assert summary.fault_class == {"swa-window-by-row-index": "swa-window-row-index"}.get(fault, fault)


# -- with a port under test -----------------------------------------------------------

PORT = "ddtree-utils:" + str(__import__("pathlib").Path(__file__).parents[1] / "fixtures/ports/ddtree_utils")


@pytest.mark.parametrize("backend", ["torch", pytest.param("sglang-triton", marks=pytest.mark.sglang)])
def test_a_window_is_folded_onto_a_ports_mask_by_its_positions(backend):
    """The port builds the tree mask and positions; the window is the attention
    backend's, folded on top as SGLang's backend would apply it."""
    summary = run(backend=backend, impl=f"{PORT}/faithful.py", sliding_window=8, topk=2, budget=16, batch=2,
                  max_new_tokens=12)
    assert summary.passed and summary.nodes_checked > 30 and summary.prefix_len_max > 8


def test_a_ports_padding_leak_is_still_caught_under_a_window():
    summary = run(backend="torch", impl=f"{PORT}/padding_visible.py", sliding_window=8, topk=1, budget=16,
                  max_new_tokens=12)
    assert not summary.passed and summary.fault_class == "padding-leak"
