"""The engine's multi-head latent attention (harness/engine/model/mla.py): the
absorbed form over the latent pool equals MLA written out per head (K and V
expanded by kv_b_proj) in float64, on both latent-capable backends' torch
path; the pool's V is a view of its K; the config.json round trip."""
from __future__ import annotations

import json
import math

import pytest
import torch

from harness.engine.attn.torch_backend import TorchBackend
from harness.engine.ddtree.verify_inputs import prefill_metadata
from harness.engine.mem.pool import KVPool
from harness.engine.model.hf_config import ModelLoadError, config_from_hf, config_to_hf
from harness.engine.model.llama import LlamaModel
from harness.engine.model.mla import mla_rope_frequencies, mla_softmax_scale
from harness.engine.model.presets import PRESETS, random_weights


def _rope_pairs(x, pos, inv_freq, mscale):
    """x  # [T, ..., d] rotated by pairs (2i, 2i+1) at positions pos  # [T]."""
    ang = pos.double()[:, None] * inv_freq[None]                          # [T, d/2]
    c, s = (ang.cos() * mscale)[:, None], (ang.sin() * mscale)[:, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = x1 * c - x2 * s, x2 * c + x1 * s
    return out


def _naive_mla(cfg, w, layer, x, pos):
    """MLA per head, causal, float64: q, K = [kv_b's k_nope | shared rotated k_pe], V from kv_b."""
    m, H, T = cfg.mla, cfg.num_heads, x.shape[0]
    p = f"model.layers.{layer}.self_attn."

    def norm(t, name):
        return w[name] * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    if m.q_lora_rank is None:
        q = x @ w[p + "q_proj.weight"].T
    else:
        q = norm(x @ w[p + "q_a_proj.weight"].T, p + "q_a_layernorm.weight") @ w[p + "q_b_proj.weight"].T
    q = q.view(T, H, m.qk_head_dim)
    kv = x @ w[p + "kv_a_proj_with_mqa.weight"].T
    latent, k_pe = norm(kv[:, :m.kv_lora_rank], p + "kv_a_layernorm.weight"), kv[:, m.kv_lora_rank:]
    kvb = (latent @ w[p + "kv_b_proj.weight"].T).view(T, H, m.qk_nope_head_dim + m.v_head_dim)
    inv_freq, mscale = mla_rope_frequencies(cfg)
    q_pe = _rope_pairs(q[..., m.qk_nope_head_dim:], pos, inv_freq, mscale)
    k_pe = _rope_pairs(k_pe[:, None], pos, inv_freq, mscale).expand(T, H, m.qk_rope_head_dim)
    qf = torch.cat([q[..., :m.qk_nope_head_dim], q_pe], -1)
    kf = torch.cat([kvb[..., :m.qk_nope_head_dim], k_pe], -1)
    s = torch.einsum("qhd,khd->hqk", qf, kf) * mla_softmax_scale(cfg)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril()[None], float("-inf"))
    o = torch.einsum("hqk,khv->qhv", s.softmax(-1), kvb[..., m.qk_nope_head_dim:])
    return o.reshape(T, -1) @ w[p + "o_proj.weight"].T


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-kimi-k2"])
def test_absorbed_mla_over_the_latent_pool_equals_mla_per_head(preset):
    cfg = PRESETS[preset]
    weights = {n: t.double() for n, t in random_weights(cfg, 3).items()}
    model = LlamaModel(cfg, weights, torch.float64, "cpu")
    T = 70   # past YaRN's original context (64)
    x = torch.randn(T, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(T)
    pool = KVPool(cfg, T + 1, torch.float64, "cpu")
    meta = prefill_metadata([T], torch.arange(1, T + 1))
    out = model.attn_layers[0](model, x, pos, None, None, meta, pool, TorchBackend("cpu", torch.float64))
    want = _naive_mla(cfg, model.w, 0, x, pos)
    assert (out - want).abs().max() < 1e-5 * want.abs().max()   # the backend and norms run in float32


def test_latent_pool_v_is_a_view_of_k():
    cfg = PRESETS["tiny-deepseek-v3"]
    pool = KVPool(cfg, 8, torch.float32, "cpu")
    m = cfg.mla
    assert pool.k_buffer[0].shape == (8, 1, m.kv_lora_rank + m.qk_rope_head_dim)
    pool.k_buffer[1][3, 0, :m.kv_lora_rank] = 7.0
    assert pool.v_buffer[1].shape == (8, 1, m.kv_lora_rank) and bool((pool.v_buffer[1][3] == 7.0).all())


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-kimi-k2", "deepseek-v3-cut"])
def test_config_json_round_trip(preset):
    cfg = PRESETS[preset]
    assert config_from_hf(json.loads(json.dumps(config_to_hf(cfg)))) == cfg


@pytest.mark.parametrize("key,value", [("topk_method", "greedy"), ("scoring_func", "softmax"),
                                       ("hidden_act", "gelu"), ("rope_interleave", False)])
def test_unimplemented_keys_are_refused(key, value):
    hf = {**config_to_hf(PRESETS["tiny-deepseek-v3"]), key: value}
    with pytest.raises(ModelLoadError, match=key):
        config_from_hf(hf)


def test_yarn_changes_the_frequencies_and_the_scale():
    cfg = PRESETS["tiny-deepseek-v3"]
    inv_freq, mscale = mla_rope_frequencies(cfg)
    plain = 1.0 / cfg.rope_theta ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    assert inv_freq[0] == plain[0] and torch.allclose(inv_freq[-1], plain[-1] / 4.0)
    assert mscale == 1.0 and math.isclose(mla_softmax_scale(cfg), 24 ** -0.5 * (0.1 * math.log(4.0) + 1) ** 2)


def test_a_backend_without_latent_attention_is_refused_by_name():
    from harness.engine.loop import Engine
    from harness.engine.settings import NotRunnableHere, RunSettings, prompt_tokens, prompts_for_batch
    from harness.engine.model.presets import load_model

    class PerHeadOnly(TorchBackend):
        runs_mla = False
    cfg, w = load_model("tiny-deepseek-v3", 0)
    specs = prompts_for_batch(1)
    with pytest.raises(NotRunnableHere, match="--backend sglang-unified does not run multi-head latent attention"):
        Engine(RunSettings(model="tiny-deepseek-v3", backend="sglang-unified"), cfg, w,
               PerHeadOnly("cpu", torch.float32), specs, [prompt_tokens(specs[0], 0, cfg.vocab_size, 0)])


def test_only_the_torch_and_triton_backends_say_they_run_latent_attention():
    from harness.engine.attn.sglang_serving import SGLangServingBackend
    from harness.engine.attn.sglang_triton import SGLangTritonBackend
    from harness.engine.attn.sglang_unified import SGLangUnifiedBackend
    assert TorchBackend.runs_mla and SGLangTritonBackend.runs_mla
    assert not SGLangUnifiedBackend.runs_mla and not SGLangServingBackend.runs_mla


@pytest.mark.sglang
def test_sglangs_triton_kernel_at_deepseek_v3s_absorbed_widths_equals_the_torch_twin():
    """K of 512 + 64 and V of 512 (Lq 576, Lv 512: the kernel's BLOCK_DMODEL + BLOCK_DPE split), two heads."""
    from ddschema import MlaConfig, ModelConfig, YarnScaling
    from harness.engine.attn.sglang_triton import SGLangTritonBackend, available
    if not available():
        pytest.skip("SGLang's kernel does not import")
    cfg = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_layers=1, num_heads=2,
                      num_kv_heads=2, head_dim=192, rope_scaling=YarnScaling(40.0, 4096, mscale_all_dim=1.0),
                      mla=MlaConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                    q_lora_rank=64))
    model = LlamaModel(cfg, random_weights(cfg, 0), torch.float32, "cpu")
    T = 6
    outs = [model.forward(torch.arange(T), torch.arange(T), prefill_metadata([T], torch.arange(1, T + 1)),
                          KVPool(cfg, T + 1, torch.float32, "cpu"), backend("cpu", torch.float32))
            for backend in (TorchBackend, SGLangTritonBackend)]
    assert (outs[0] - outs[1]).abs().max() < 1e-5 * outs[0].abs().max()


def test_transformers_5s_rope_parameters_read_and_a_quantized_checkpoint_refused():
    cfg = PRESETS["tiny-deepseek-v3"]
    hf = config_to_hf(cfg)
    yarn, theta = hf.pop("rope_scaling"), hf.pop("rope_theta")
    assert config_from_hf({**hf, "rope_parameters": {**yarn, "rope_type": "yarn", "rope_theta": theta}}) == cfg
    with pytest.raises(ModelLoadError, match="quantization_config"):
        config_from_hf({**config_to_hf(cfg), "quantization_config": {"quant_method": "fp8"}})
