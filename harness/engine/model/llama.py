"""The target model under test: a Llama-family decoder that reads and writes
a paged KV pool through an attention backend (SGLang's RadixAttention seam).

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ddschema import ModelConfig
from harness.engine.attn.base import AttentionBackend, LayerAttention
from harness.engine.mem.pool import KVPool
from harness.engine.ddtree.verify_inputs import AttnMetadata


class LlamaModel:
    """Weights in the run dtype on the run device; `forward` is the verify
    (or prefill) forward of one batch."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: str):
        self.cfg = cfg
        self.dtype = dtype
        self.w = {n: t.to(device=device, dtype=dtype) for n, t in weights.items()}
        self.inv_freq = rope_frequencies(cfg).to(device)  # [head_dim/2] float64
        # Gemma 3's sliding layers rotate with their own base and no scaling (rope_local_base_freq)
        self.inv_freq_local = None if cfg.rope_local_theta is None else \
            rope_frequencies(replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None)).to(device)
        self.layer_attn = [layer_attention(cfg, weights, i, device) for i in range(cfg.num_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                pool: KVPool, backend: AttentionBackend,
                hidden_out: list[torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, positions  # [T]; returns logits  # [T, vocab] float32.
        If `hidden_out` is a list, the residual stream after the embedding and
        after each layer is appended to it ([T, hidden] each)."""
        cfg, w = self.cfg, self.w
        h = w["model.embed_tokens.weight"][input_ids]  # [T, hidden]
        if cfg.embed_scale != 1.0:   # Gemma: a Python float, as SGLang's scaled embedding multiplies
            h = h * cfg.embed_scale
        ropes = {False: self._rope(positions, self.inv_freq)}   # by "is a sliding layer with its own base"
        if self.inv_freq_local is not None:
            ropes[True] = self._rope(positions, self.inv_freq_local)
        windowed = self._window_meta(meta, positions)
        if hidden_out is not None:
            hidden_out.append(h.float().clone())
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            layer_meta = meta if cfg.window_of(i) is None else windowed
            cos, sin = ropes[self.inv_freq_local is not None and i in cfg.sliding_layers]
            x = self._norm(h, p + "input_layernorm.weight")
            attn = self._attention(i, p, x, cos, sin, layer_meta, pool, backend)
            if cfg.sandwich_norms:   # Gemma: post_attention_layernorm normalizes the attention's output
                h = h + self._norm(attn, p + "post_attention_layernorm.weight")
                h = h + self._norm(self._mlp(p, self._norm(h, p + "pre_feedforward_layernorm.weight")),
                                   p + "post_feedforward_layernorm.weight")
            else:
                h = h + attn
                h = h + self._mlp(p, self._norm(h, p + "post_attention_layernorm.weight"))
            if hidden_out is not None:
                hidden_out.append(h.float().clone())
        h = self._norm(h, "model.norm.weight")
        head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
        logits = (h @ head.T).float()   # [T, vocab]
        cap = cfg.final_logit_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if self.cfg.norm_plus_one:
            return _gemma_rms_norm(x, self.w[name], self.cfg.rms_norm_eps)
        return _rms_norm(x, self.w[name], self.cfg.rms_norm_eps)

    def _window_meta(self, meta: AttnMetadata, positions: torch.Tensor) -> AttnMetadata:
        """What the sliding-window layers read: the metadata's window mask; for a
        causal extend (prefill: no custom mask) the model folds the window itself.
        A verify batch built without a window mask leaves the window off (its
        layers read custom_mask), as a server that never filled the window does."""
        w = self.cfg.sliding_window
        if w is None:
            return meta
        if meta.window_mask is None and meta.custom_mask is None:
            from harness.engine.ddtree.window import with_window
            meta = with_window(meta, positions, w)
        return meta.windowed() if meta.window_mask is not None else meta

    def _attention(self, i, p, x, cos, sin, meta, pool, backend) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        T = x.shape[0]
        q = F.linear(x, w[p + "self_attn.q_proj.weight"], w.get(p + "self_attn.q_proj.bias"))
        k = F.linear(x, w[p + "self_attn.k_proj.weight"], w.get(p + "self_attn.k_proj.bias"))
        v = F.linear(x, w[p + "self_attn.v_proj.weight"], w.get(p + "self_attn.v_proj.bias"))
        q = q.view(T, cfg.num_heads, cfg.head_dim)      # [T, heads, d]
        k = k.view(T, cfg.num_kv_heads, cfg.head_dim)   # [T, kv_heads, d]
        v = v.view(T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = self._norm(q, p + "self_attn.q_norm.weight")
            k = self._norm(k, p + "self_attn.k_norm.weight")
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        if getattr(backend, "writes_kv", False):   # SGLang's RadixAttention saves the rows' K/V itself
            pool.mark_written(i, meta.out_cache_loc)
        else:
            pool.set_kv(i, meta.out_cache_loc, k, v)  # K is cached after RoPE
        o = backend.forward(q, k, v, i, pool.k_buffer[i], pool.v_buffer[i], meta, self.layer_attn[i])
        return F.linear(o.reshape(T, -1), w[p + "self_attn.o_proj.weight"], w.get(p + "self_attn.o_proj.bias"))

    def _mlp(self, p, x) -> torch.Tensor:
        w = self.w
        gate = F.linear(x, w[p + "mlp.gate_proj.weight"])
        up = F.linear(x, w[p + "mlp.up_proj.weight"])
        act = F.silu(gate) if self.cfg.hidden_act == "silu" else F.gelu(gate, approximate="tanh")
        return F.linear(act * up, w[p + "mlp.down_proj.weight"])

    def _rope(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float64)[:, None] * inv_freq[None]  # [T, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(self.dtype)[:, None], emb.sin().to(self.dtype)[:, None]  # [T, 1, d]


def layer_attention(cfg: ModelConfig, weights: dict[str, torch.Tensor], layer: int, device: str) -> LayerAttention:
    """The layer's sinks  # [heads] float32, soft cap and score scale, as the attention backend takes them."""
    sinks = weights[f"model.layers.{layer}.self_attn.sinks"] if cfg.attn_sinks else None
    scaling = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar ** -0.5
    return LayerAttention(None if sinks is None else sinks.to(device=device, dtype=torch.float32),
                          cfg.attn_logit_softcap or 0.0, scaling)


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim/2] float64; with llama3 scaling,
    long wavelengths (> original / low_freq_factor) are divided by `factor`,
    short ones (< original / high_freq_factor) kept, and the band between
    interpolated linearly in original / wavelength."""
    half = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** half  # [d/2]
    r = cfg.rope_scaling
    if r is None:
        return inv_freq
    ratio = r.original_max_position * inv_freq / (2 * torch.pi)  # original / wavelength, [d/2]
    blend = ((ratio - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)).clamp(0.0, 1.0)
    return inv_freq / r.factor * (1 - blend) + inv_freq * blend


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: scaled by (1 + weight), multiplied in float32 before the cast back."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
