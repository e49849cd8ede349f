"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) in the absorbed form
SGLang serves it in: the pool caches one latent per token, [kv_lora_rank
normed latent | qk_rope_head_dim rotated RoPE key], read by the kernel as one
KV "head" of that width for K and of width kv_lora_rank for V (a view of the
same storage). kv_b_proj's no-RoPE key part is folded into the query
(q_nope @ W_UK), its value part applied after attention (o @ W_UV^T).

RoPE rotates interleaved pairs (2i, 2i+1), as DeepSeek's checkpoints store
them and SGLang's non-neox rotary does, with YaRN's frequencies and its
cos/sin magnitude correction; the score scale is qk_head_dim**-0.5 times
mscale(factor, mscale_all_dim)**2.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddschema import ModelConfig, YarnScaling
from harness.engine.attn.base import LayerAttention


def yarn_mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def mla_rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq  # [qk_rope_head_dim/2] float64, the cos/sin magnitude) with YaRN when configured:
    dimensions turning more than beta_fast times over the original context keep their
    frequency, fewer than beta_slow are divided by `factor`, a linear ramp between."""
    dim, base = cfg.mla.qk_rope_head_dim, cfg.rope_theta
    extra = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)   # [dim/2]
    r = cfg.rope_scaling
    if not isinstance(r, YarnScaling):
        return extra, 1.0

    def dim_of(turns: float) -> float:   # the rotary dimension that turns `turns` times over the original context
        return dim * math.log(r.original_max_position / (turns * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(dim_of(r.beta_fast)), 0)
    high = min(math.ceil(dim_of(r.beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    keep = 1.0 - ramp                                                             # 1: keep the frequency
    inv_freq = extra / r.factor * (1 - keep) + extra * keep
    return inv_freq, yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim)


def mla_softmax_scale(cfg: ModelConfig) -> float:
    scale = cfg.mla.qk_head_dim ** -0.5
    r = cfg.rope_scaling
    if isinstance(r, YarnScaling) and r.mscale_all_dim:
        scale *= yarn_mscale(r.factor, r.mscale_all_dim) ** 2
    return scale


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x  # [T, ..., d] rotated by pairs (2i, 2i+1); cos, sin  # [T, 1, d/2]."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


@dataclass(frozen=True)
class MlaLayer:
    """One layer's absorbed weights: w_uk  # [heads, nope, rank], w_uv  # [heads, v, rank]."""

    layer: int
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    attn: LayerAttention

    @staticmethod
    def build(model, layer: int) -> "MlaLayer":
        cfg, m = model.cfg, model.cfg.mla
        kv_b = model.w[f"model.layers.{layer}.self_attn.kv_b_proj.weight"]   # [heads*(nope+v), rank]
        kv_b = kv_b.view(cfg.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return MlaLayer(layer, kv_b[:, :m.qk_nope_head_dim].contiguous(), kv_b[:, m.qk_nope_head_dim:].contiguous(),
                        LayerAttention(scaling=mla_softmax_scale(cfg)))

    def __call__(self, model, x, positions, meta, pool, backend) -> torch.Tensor:
        """x  # [T, hidden] -> the attention's output  # [T, hidden]."""
        cfg, m, w, stages = model.cfg, model.cfg.mla, model.w, model.stages
        p = f"model.layers.{self.layer}.self_attn."
        T = x.shape[0]
        if m.q_lora_rank is None:
            q = F.linear(x, w[p + "q_proj.weight"])
        else:
            q = F.linear(model._norm(F.linear(x, w[p + "q_a_proj.weight"]), p + "q_a_layernorm.weight"),
                         w[p + "q_b_proj.weight"])
        q = q.view(T, cfg.num_heads, m.qk_head_dim)                              # [T, heads, nope+rope]
        q_nope, q_pe = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
        kv = F.linear(x, w[p + "kv_a_proj_with_mqa.weight"])                     # [T, rank+rope]
        latent = model._norm(kv[:, :m.kv_lora_rank], p + "kv_a_layernorm.weight")  # [T, rank]
        cos, sin = model.mla_rope(positions)
        kcos, ksin = model.mla_rope(stages.latent_rope_positions(positions, meta))
        q_pe = rope_interleaved(q_pe, cos, sin)                                  # [T, heads, rope]
        k_pe = rope_interleaved(kv[:, None, m.kv_lora_rank:], kcos, ksin)         # [T, 1, rope]
        q_abs = torch.einsum("thn,hnr->thr", q_nope, self.w_uk)                   # [T, heads, rank]
        q_full = torch.cat([q_abs, q_pe], dim=-1)                                 # [T, heads, rank+rope]
        k = torch.cat([latent[:, None], k_pe], dim=-1)                            # [T, 1, rank+rope]
        v = latent[:, None]                                                       # [T, 1, rank]
        if getattr(backend, "writes_kv", False):
            pool.mark_written(self.layer, meta.out_cache_loc)
        else:
            pool.set_kv(self.layer, stages.latent_slots(meta.out_cache_loc, meta), k, v)
        o = backend.forward(q_full, k, v, self.layer, pool.k_buffer[self.layer], pool.v_buffer[self.layer],
                            meta, self.attn)                                      # [T, heads, rank]
        o = torch.einsum("thr,hvr->thv", o, self.w_uv)                            # [T, heads, v]
        return F.linear(o.reshape(T, -1), w[p + "o_proj.weight"])
