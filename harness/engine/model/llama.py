"""The target model under test: a Llama-family decoder that reads and writes
a paged KV pool through an attention backend (SGLang's RadixAttention seam).

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ddschema import ModelConfig
from harness.engine.attn.base import AttentionBackend, LayerAttention
from harness.engine.mem.pool import KVPool
from harness.engine.model.mla import MlaLayer, mla_rope_frequencies
from harness.engine.model.moe import MoeLayer
from harness.engine.model.stages import ModelStages
from harness.engine.ddtree.verify_inputs import AttnMetadata


@dataclass(frozen=True)
class GqaLayer:
    """Grouped-query attention with per-head K/V (Llama, Qwen, Mistral, Gemma): the model's own method."""

    layer: int

    @staticmethod
    def build(model, layer: int) -> "GqaLayer":
        return GqaLayer(layer)

    def __call__(self, model, x, positions, cos, sin, meta, pool, backend) -> torch.Tensor:
        return model._attention(self.layer, f"model.layers.{self.layer}.", x, cos, sin, meta, pool, backend)


@dataclass(frozen=True)
class MlaAdapter:
    """Multi-head latent attention (mla.py); it rotates with its own frequencies, not the layer's cos/sin."""

    mla: MlaLayer

    @staticmethod
    def build(model, layer: int) -> "MlaAdapter":
        return MlaAdapter(MlaLayer.build(model, layer))

    def __call__(self, model, x, positions, cos, sin, meta, pool, backend) -> torch.Tensor:
        return self.mla(model, x, positions, meta, pool, backend)


@dataclass(frozen=True)
class DenseMlp:
    layer: int

    @staticmethod
    def build(model, layer: int) -> "DenseMlp":
        return DenseMlp(layer)

    def __call__(self, model, x, positions, meta) -> torch.Tensor:
        return model._mlp(f"model.layers.{self.layer}.", x)


# attention and MLP kinds by name: (model, layer) -> the layer's callable
ATTENTIONS = {"gqa": GqaLayer.build, "mla": MlaAdapter.build}
MLPS = {"dense": DenseMlp.build, "moe": MoeLayer.build}


def attention_kind(cfg: ModelConfig) -> str:
    return "gqa" if cfg.mla is None else "mla"


def mlp_kind(cfg: ModelConfig, layer: int) -> str:
    return "moe" if cfg.moe is not None and cfg.moe.is_moe_layer(layer) else "dense"


class LlamaModel:
    """Weights in the run dtype on the run device; `forward` is the verify
    (or prefill) forward of one batch."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: str,
                 stages: ModelStages = ModelStages()):
        self.cfg = cfg
        self.dtype = dtype
        self.stages = stages
        self.routing_out = None   # a list: each MoE layer's Routing of each forward is appended (moe.py)
        self.w = {n: t.to(device=device, dtype=dtype) for n, t in weights.items()}
        # [head_dim/2] float64; MLA rotates only its qk_rope_head_dim part, with YaRN (mla.py)
        if cfg.mla is None:
            self.inv_freq, self.mla_mscale = rope_frequencies(cfg).to(device), 1.0
        else:
            freq, self.mla_mscale = mla_rope_frequencies(cfg)
            self.inv_freq = freq.to(device)
        # Gemma 3's sliding layers rotate with their own base and no scaling (rope_local_base_freq)
        self.inv_freq_local = None if cfg.rope_local_theta is None else \
            rope_frequencies(replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None)).to(device)
        self.layer_attn = [layer_attention(cfg, weights, i, device) for i in range(cfg.num_layers)]
        self.attn_layers = [ATTENTIONS[attention_kind(cfg)](self, i) for i in range(cfg.num_layers)]
        self.mlp_layers = [MLPS[mlp_kind(cfg, i)](self, i) for i in range(cfg.num_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                pool: KVPool, backend: AttentionBackend,
                hidden_out: list[torch.Tensor] | None = None, logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions  # [T]; returns logits  # [T, vocab] float32.
        If `hidden_out` is a list, the residual stream after the embedding and
        after each layer is appended to it ([T, hidden] each). With
        `logit_rows`  # [R] int64, only those positions' logits: [R, vocab] (R may be 0: K/V only)."""
        cfg, w = self.cfg, self.w
        h = w["model.embed_tokens.weight"][input_ids]  # [T, hidden]
        if cfg.embed_scale != 1.0:   # Gemma: a Python float, as SGLang's scaled embedding multiplies
            h = h * cfg.embed_scale
        ropes = {False: self._rope(positions, self.inv_freq) if cfg.mla is None else (None, None)}   # by "is a sliding layer with its own base"
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
            attn = self.attn_layers[i](self, x, positions, cos, sin, layer_meta, pool, backend)
            mlp = self.mlp_layers[i]
            if cfg.sandwich_norms:   # Gemma: post_attention_layernorm normalizes the attention's output
                h = h + self._norm(attn, p + "post_attention_layernorm.weight")
                h = h + self._norm(mlp(self, self._norm(h, p + "pre_feedforward_layernorm.weight"), positions, meta),
                                   p + "post_feedforward_layernorm.weight")
            else:
                h = h + attn
                h = h + mlp(self, self._norm(h, p + "post_attention_layernorm.weight"), positions, meta)
            if hidden_out is not None:
                hidden_out.append(h.float().clone())
        if logit_rows is not None:   # the final norm and the head are per position: the other rows are never read
            h = h[logit_rows]   # [R, hidden]
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

    def mla_rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA's interleaved-pair cos, sin  # [T, 1, rope/2] with YaRN's magnitude correction."""
        freqs = positions.to(torch.float64)[:, None] * self.inv_freq[None]   # [T, rope/2]
        return ((freqs.cos() * self.mla_mscale).to(self.dtype)[:, None],
                (freqs.sin() * self.mla_mscale).to(self.dtype)[:, None])


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
