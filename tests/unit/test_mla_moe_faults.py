"""The MLA/MoE faults (harness/faults/mla_moe.py) break what their lines say,
on verify forwards only, and the model audit (localize/model_audit.py)
names each from what it measures: the latent pool against an oracle's
latents (here the engine's own float64 model, a stand-in for path_latent)
and the experts' reads against the padding rows."""
from __future__ import annotations

from dataclasses import replace

import torch

from harness.check.localize.layer_bisect import capture_hidden
from harness.check.localize.model_audit import audit_expert_reads, audit_latents, audit_row_latents
from harness.engine.attn.torch_backend import TorchBackend
from harness.engine.ddtree.verify_inputs import prefill_metadata
from harness.engine.loop import Engine
from harness.engine.mem.pool import KVPool
from harness.engine.model.llama import LlamaModel
from harness.engine.model.presets import load_model
from harness.engine.settings import RunSettings, prompt_tokens, prompts_for_batch
from harness.faults import apply_fault
from harness.engine.model.stages import padding_rows
from harness.faults.mla_moe import latent_slots_reversed, latent_rope_at_flat_index, router_reads_padding

MODEL = "tiny-deepseek-v3"


class _Meta:
    def __init__(self, qo, mask=True):
        self.qo_indptr, self.custom_mask = torch.tensor(qo), (torch.ones(1) if mask else None)


def test_stages_change_verify_rows_only():
    pos = torch.tensor([10, 11, 11, 12, 10, 20, 21, 22, 20, 20])   # two requests of 5: root, 3 nodes / 2 nodes, padding
    meta = _Meta([0, 5, 10])
    assert latent_rope_at_flat_index(pos, meta).tolist() == [10, 11, 12, 13, 14, 20, 21, 22, 23, 24]
    assert latent_slots_reversed(torch.arange(10), meta).tolist() == [4, 3, 2, 1, 0, 9, 8, 7, 6, 5]
    assert router_reads_padding(pos, meta).tolist() == [0, 1, 2, 4, 4, 5, 6, 8, 8, 9]
    prefill = _Meta([0, 10], mask=False)
    assert torch.equal(latent_rope_at_flat_index(pos, prefill), pos)
    assert torch.equal(latent_slots_reversed(torch.arange(10), prefill), torch.arange(10))
    assert router_reads_padding(pos, prefill).tolist() == list(range(10))


class _SelfOracle:
    """path_latent from the engine's own float64 model over a fault-free causal forward."""

    def __init__(self, cfg, weights):
        self.cfg, self.model = cfg, LlamaModel(cfg, {n: t.double() for n, t in weights.items()}, torch.float64, "cpu")

    def path_latent(self, tokens):
        n = len(tokens)
        pool = KVPool(self.cfg, n + 1, torch.float64, "cpu")
        self.model.forward(torch.tensor(tokens), torch.arange(n), prefill_metadata([n], torch.arange(1, n + 1)),
                           pool, TorchBackend("cpu", torch.float64))
        return torch.stack([k[1:, 0] for k in pool.k_buffer])          # [L, n, rank+rope]


def _engine(fault, **kw):
    s = RunSettings(model=MODEL, fault=fault, max_new_tokens=10, **kw)
    cfg, w = load_model(MODEL, 0)
    specs = prompts_for_batch(1)
    ids = [prompt_tokens(specs[0], 0, cfg.vocab_size, 0)]
    return Engine(s, cfg, w, TorchBackend("cpu", torch.float32), specs, ids, apply_fault(fault, s, cfg.vocab_size)), \
        _SelfOracle(cfg, w)


def _latent_hints(fault, **kw):
    engine, oracle = _engine(fault, **kw)
    seen, hints = set(), []
    for result in engine.rounds():
        hints += [w.hint for w in audit_latents(engine, result, oracle, 1e-4, seen)]
    return hints


def test_the_latent_audit_names_each_latent_fault_and_passes_a_clean_run():
    assert _latent_hints(None, topk=2) == []
    assert _latent_hints("mla-latent-wrong-slot")[:1] == ["latent-wrong-slot"]
    assert _latent_hints("mla-rope-flat-index", topk=2)[:1] == ["latent-rope-position"]


def test_the_expert_read_audit_names_the_padding_dispatch_and_passes_a_clean_run():
    for fault, want in ((None, []), ("moe-router-reads-padding", ["moe-padding-dispatch"])):
        engine, _ = _engine(fault)
        result = next(iter(engine.rounds()))
        assert [w.hint for w in audit_expert_reads(engine, result, 0, 1e-4)] == want


def test_the_row_audit_names_the_divergent_rounds_latents_before_any_is_committed():
    for fault, kw, want in ((None, {"topk": 2}, []), ("mla-rope-flat-index", {"topk": 2}, ["latent-rope-position"]),
                            ("mla-latent-wrong-slot", {}, ["latent-wrong-slot"])):
        engine, oracle = _engine(fault, **kw)
        result = next(iter(engine.rounds()))
        capture_hidden(engine, result)   # the round's forward again: its latents back in their slots
        assert [w.hint for w in audit_row_latents(engine, result, oracle, 1e-4, 0)] == want


def test_stages_read_nothing_back_to_the_host_so_cuda_graphs_capture_them(monkeypatch):
    """The CPU twin of capture: a .tolist()/.item()/int() of a device tensor inside a CUDA graph capture raises
    ("Cannot copy between CPU and CUDA tensors during CUDA graph capture"), as the first versions of these faults did
    on an H100. Rows past qo_indptr[-1] (a graph bucket above the batch) are left as they are."""
    pos = torch.tensor([10, 11, 11, 12, 10, 20, 21, 22, 20, 20, 0, 0])
    meta = _Meta([0, 5, 10])

    def host_read(*_):
        raise AssertionError("a host read of a device tensor")
    for name in ("tolist", "item", "__int__", "__bool__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    out = (latent_rope_at_flat_index(pos, meta), latent_slots_reversed(torch.arange(12), meta),
           router_reads_padding(pos, meta), padding_rows(pos, meta))
    monkeypatch.undo()
    assert out[0].tolist() == [10, 11, 12, 13, 14, 20, 21, 22, 23, 24, 0, 0]
    assert out[1].tolist() == [4, 3, 2, 1, 0, 9, 8, 7, 6, 5, 10, 11]
    assert out[2].tolist() == [0, 1, 2, 4, 4, 5, 6, 8, 8, 9, 10, 11]
    assert out[3].tolist() == [False] * 4 + [True] + [False] * 3 + [True, True, False, False]
