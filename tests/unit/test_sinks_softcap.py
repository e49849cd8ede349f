"""Attention sinks and logit soft-capping (issue 11): the oracle's math by
hand, the engine's torch backend against it, both loaders reading them, a
fault-free run on each, and the sinks-first-row-only fault (plus a backend
that drops the sinks or the cap everywhere) named from the attention audit's
evidence."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from ddschema import weight_names
from harness.engine.attn.base import LayerAttention
from harness.engine.attn.torch_backend import _attend
from harness.check.differential import check
from harness.check.prepare import prepare
from harness.faults.catalog import _SinksFirstRowOnly
from harness.engine.model.hf_config import config_from_hf
from harness.engine.model.presets import PRESETS, load_checkpoint, random_weights, write_checkpoint
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings
from reference.checkpoint import load_checkpoint as oracle_load, read_config
from reference.model import attention
from tests.unit.test_checkpoint import BASE


def test_the_oracle_adds_one_sink_term_per_head_to_the_denominator():
    q = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)            # [1 row, 1 head, d 2]
    k = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=torch.float64)
    v = torch.tensor([[[2.0, 0.0]], [[0.0, 4.0]]], dtype=torch.float64)
    visible = torch.ones(1, 2, dtype=torch.bool)
    s0, s1, sink = 1 / math.sqrt(2), 0.0, 0.5
    z = math.exp(s0) + math.exp(s1) + math.exp(sink)
    want = torch.tensor([2 * math.exp(s0) / z, 4 * math.exp(s1) / z], dtype=torch.float64)
    got = attention(q, k, v, visible, sinks=torch.tensor([sink], dtype=torch.float64))
    assert torch.allclose(got[0, 0], want, atol=1e-15)


def test_the_oracle_soft_caps_the_scaled_scores_before_the_mask():
    q = torch.tensor([[[4.0, 0.0]]], dtype=torch.float64)
    k = torch.tensor([[[4.0, 0.0]], [[0.0, 1.0]], [[9.0, 0.0]]], dtype=torch.float64)
    v = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[5.0, 5.0]]], dtype=torch.float64)
    visible = torch.tensor([[True, True, False]])
    cap = 2.0
    s = [cap * math.tanh(16 / math.sqrt(2) / cap), 0.0]
    z = sum(math.exp(x) for x in s)
    got = attention(q, k, v, visible, softcap=cap)
    assert torch.allclose(got[0, 0], torch.tensor([math.exp(s[0]) / z, math.exp(s[1]) / z], dtype=torch.float64))


def test_the_engines_torch_backend_agrees_with_the_oracle_on_sinks_and_cap():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    visible = torch.rand(5, 5, generator=g) < 0.6
    visible[:, 0] = True
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    want = attention(q, k, v, visible, sinks=sinks, softcap=1.5)
    got = _attend(q.float(), k.float(), v.float(), visible, LayerAttention(sinks.float(), 1.5)).double()
    assert (got - want).abs().max() < 1e-5
    plain = attention(q, k, v, visible)
    assert (got - plain).abs().max() > 1e-2   # the sinks and the cap change the output


def test_both_loaders_read_the_cap_from_config_and_the_sinks_from_the_tensors(tmp_path):
    hf = {**BASE, "architectures": ["LlamaForCausalLM"], "attn_logit_softcapping": 30.0}
    assert config_from_hf(hf).attn_logit_softcap == 30.0 == read_config(hf).attn_logit_softcap
    cfg = PRESETS["tiny-sinks"]
    write_checkpoint(tmp_path, cfg, random_weights(cfg, 0))
    assert "attn_logit_softcapping" not in json.loads((tmp_path / "config.json").read_text())
    engine_cfg, _ = load_checkpoint(tmp_path)
    oracle_cfg, weights = oracle_load(tmp_path)
    assert engine_cfg.attn_sinks and oracle_cfg.attn_sinks and engine_cfg == oracle_cfg
    assert weights["model.layers.1.self_attn.sinks"].shape == (cfg.num_heads,)


def test_a_checkpoint_with_sinks_in_some_layers_only_is_refused(tmp_path):
    cfg = PRESETS["tiny-sinks"]
    weights = random_weights(cfg, 0)
    from safetensors.torch import save_file
    from harness.engine.model.hf_config import ModelLoadError, config_to_hf
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(cfg)))
    kept = {n: t for n, t in weights.items() if n != "model.layers.1.self_attn.sinks"}
    save_file(kept, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="self_attn.sinks"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="self_attn.sinks"):
        oracle_load(tmp_path)


def _run(model: str, backend: str = "torch", attention=None, localize: bool = True, **kw):
    p = prepare(RunSettings(model=model, backend=backend, budget=8, max_new_tokens=10, **kw))
    if attention is not None:
        from harness.check.prepare import derive
        p = derive(p, pipeline=replace(p.engine.pipeline, attention=attention))
    return check(p, RecordWriter(None), localize=localize)


@pytest.mark.parametrize("model", ["tiny-sinks", "tiny-softcap"])
def test_a_fault_free_run_with_sinks_or_cap_passes(model):
    s = _run(model, topk=2)
    assert s.passed and s.nodes_checked > 0, s.explanation


class _Drop:
    """A backend that drops one of the layer's extras on every row."""

    def __init__(self, inner, what):
        self.inner, self.what = inner, what
        self.name, self.mask_regions, self.graph_capturable = inner.name, inner.mask_regions, inner.graph_capturable

    def forward(self, q, k, v, layer, kb, vb, meta, layer_attn=LayerAttention()):
        return self.inner.forward(q, k, v, layer, kb, vb, meta, replace(layer_attn, **{self.what: self.default}))

    @property
    def default(self):
        return None if self.what == "sinks" else 0.0


@pytest.mark.parametrize("model,what,cls", [("tiny-sinks", "sinks", "sinks-dropped"),
                                            ("tiny-softcap", "logit_cap", "softcap-dropped")])
def test_a_backend_dropping_sinks_or_cap_is_caught_and_named_by_what_it_drops(model, what, cls):
    s = _run(model, attention=lambda b: _Drop(b, what))
    assert not s.passed
    assert (s.stage, s.quantity, s.fault_class) == ("attention", what, cls), s.explanation
    assert "on rows 0-" in s.explanation


def test_sinks_on_the_first_row_only_is_named_with_the_rows_that_lost_them():
    s = _run("tiny-sinks", attention=_SinksFirstRowOnly)
    assert not s.passed and s.fault_class == "sinks-first-row-only", s.explanation
    assert "drops the layer's sink logits on rows 1-8" in s.explanation


@pytest.mark.sglang
@pytest.mark.parametrize("model,backend", [("tiny-sinks", "sglang-triton"), ("tiny-softcap", "sglang-unified")])
def test_sglangs_kernels_take_the_sinks_and_the_cap(model, backend):
    """The oracle applies them: a kernel that ignored SGLang's `sinks` / `logit_cap` arguments would diverge."""
    s = _run(model, backend=backend, topk=2, localize=False)
    assert s.passed and s.max_rel_err < 1e-4, s.explanation
