"""A dense float64 DeepSeek-V3 / Kimi K2 forward (DeepseekV3ForCausalLM), no KV cache.

The Llama-family frame of reference/model.py (embedding, pre-norm residual
blocks, final norm, lm_head, causal visibility, a cached past, rounding to a
low precision) with the two parts that differ written out here:

Multi-head latent attention, per token x (normed, [hidden]):
  * q = q_b_proj(RMSNorm(q_a_proj(x), q_a_layernorm)) (q_proj(x) when
    q_lora_rank is null), H heads of qk_nope_head_dim + qk_rope_head_dim,
    split into q_nope and q_pe;
  * kv_a_proj_with_mqa(x) = [c | k_pe]: the compressed latent c
    (kv_lora_rank, then RMSNorm by kv_a_layernorm) and one RoPE key k_pe
    (qk_rope_head_dim) shared by every head;
  * RoPE on q_pe and k_pe rotates INTERLEAVED pairs (2i, 2i+1) by position *
    inv_freq[i] and keeps them interleaved (DeepSeek's checkpoints and
    SGLang's is_neox_style=False; Hugging Face de-interleaves to
    [evens | odds] first, the same scores because q and k are permuted
    alike); inv_freq and cos/sin follow YaRN (reference/rope.py);
  * the cached latent of a token is [c | rotated k_pe], kv_lora_rank +
    qk_rope_head_dim wide: MlaForwardResult.ks;
  * kv_b_proj(c) gives each head k_nope (qk_nope_head_dim) and v
    (v_head_dim); k = [k_nope | k_pe], q = [q_nope | q_pe];
  * softmax scale (qk_nope + qk_rope)^-0.5 * mscale(factor, mscale_all_dim)^2;
  * o_proj over the H * v_head_dim outputs.
Mixture of experts on layers from first_k_dense_replace on (reference/moe.py):
the router reads the post-attention-normed hidden state; earlier layers
(and every layer of a config without routed experts) keep a dense SwiGLU.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ddschema.config import ModelConfig
from reference.model import DTYPE, DenseLlama, attention
from reference.moe import Selection, combine, select_experts
from reference.names import mla_moe_shapes
from reference.rope import rope_inv_freq, yarn_cos_sin_scale, yarn_inv_freq, yarn_softmax_factor


class MlaForwardResult(NamedTuple):
    """ForwardResult's fields for an MLA model, plus its routing.

    logits [T, V]; hiddens: num_layers + 1 tensors [T, hidden];
    ks: per layer the cached latent [T, kv_lora_rank + qk_rope_head_dim]
        (normed c, then k_pe rotated at the token's position, interleaved);
    vs: the same tensors (MLA caches one latent for K and V);
    routes: one Selection per MoE layer, in layer order (reference/moe.py).
    """

    logits: Tensor
    hiddens: list[Tensor]
    ks: list[Tensor]
    vs: list[Tensor]
    routes: tuple[Selection, ...] = ()


def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, ..., d] with pairs (2i, 2i+1) rotated by cos/sin [T, d/2]; the layout stays interleaved."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    even, odd = x[..., 0::2], x[..., 1::2]  # [T, ..., d/2] each
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)  # [T, ..., d]


def mla_cos_sin(positions: Tensor, config: ModelConfig) -> tuple[Tensor, Tensor]:
    """cos, sin [T, qk_rope_head_dim / 2] float64 for integer positions [T]: YaRN's frequencies
    and magnitude when the config scales RoPE, plain ones otherwise."""
    rotary, scaling = config.mla.qk_rope_head_dim, config.rope_scaling
    if scaling is None:
        inv_freq, magnitude = rope_inv_freq(rotary, config.rope_theta), 1.0
    else:
        inv_freq, magnitude = yarn_inv_freq(rotary, config.rope_theta, scaling), yarn_cos_sin_scale(scaling)
    angles = positions.to(DTYPE)[:, None] * inv_freq[None, :]  # [T, d/2]
    return angles.cos() * magnitude, angles.sin() * magnitude


class DenseDeepseekV3(DenseLlama):
    """DeepSeek-V3-layout decoder in float64 (see the module docstring). Takes the
    same weights dict (Hugging Face names, reference/names.py) and device
    arguments as DenseLlama, and checks the MLA and MoE tensors' shapes."""

    def __init__(self, config: ModelConfig, weights: dict[str, Tensor], device: str = "cpu",
                 owned: bool = False) -> None:
        if config.mla is None:
            raise ValueError("DenseDeepseekV3 needs a config with MLA (ModelConfig.mla)")
        for name, shape in mla_moe_shapes(config).items():
            if name in weights and tuple(weights[name].shape) != shape:
                raise ValueError(f"{name} has shape {list(weights[name].shape)}, the config implies {list(shape)}")
        super().__init__(config, weights, device, owned)
        self._route_sink: list[Selection] | None = None

    def forward(self, token_ids: list[int], positions: list[int] | None = None, visible: Tensor | None = None,
                last_logits_only: bool = False, past=None) -> MlaForwardResult:
        """DenseLlama.forward's contract (past: per layer the latents of the
        tokens before, as ks/vs here), and each MoE layer's routing."""
        sink: list[Selection] = []
        self._route_sink = sink
        try:
            result = super().forward(token_ids, positions, visible, last_logits_only, past)
        finally:
            self._route_sink = None
        return MlaForwardResult(*result, routes=tuple(sink))

    __call__ = forward

    def _rope_tables(self, pos: Tensor) -> list[tuple[Tensor, Tensor]]:
        cos, sin = (t.to(self.device) for t in mla_cos_sin(pos, self.config))  # [T, r/2] each
        return [(cos, sin)] * self.config.num_layers

    def _attention_block(self, layer: int, x: Tensor, cos: Tensor, sin: Tensor, visible: Tensor,
                         past: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """MLA on the normed x [T, hidden]; past: this layer's latents [P, R + r]
        (twice). Returns (output [T, hidden], latent [T, R + r], the same latent)."""
        c, m, p = self.config, self.config.mla, f"model.layers.{layer}.self_attn."
        t, heads = x.shape[0], c.num_heads
        if m.q_lora_rank is None:
            q = self._linear(x, p + "q_proj")
        else:
            q = self._linear(self._norm(self._linear(x, p + "q_a_proj"), p + "q_a_layernorm.weight"), p + "q_b_proj")
        q = q.view(t, heads, m.qk_head_dim)  # [T, H, nope + rope]
        kv = self._linear(x, p + "kv_a_proj_with_mqa")  # [T, R + r]
        compressed = self._norm(kv[:, :m.kv_lora_rank], p + "kv_a_layernorm.weight")  # [T, R]
        k_pe = self.store(rope_interleaved(kv[:, m.kv_lora_rank:], cos, sin))  # [T, r]
        q_pe = self.store(rope_interleaved(q[..., m.qk_nope_head_dim:], cos, sin))  # [T, H, r]
        latent = torch.cat([compressed, k_pe], dim=-1)  # [T, R + r]
        every = latent if past is None else torch.cat([past[0], latent])  # [S, R + r]
        s = every.shape[0]
        kv_heads = self._linear(every[:, :m.kv_lora_rank], p + "kv_b_proj").view(s, heads, -1)  # [S, H, nope + v]
        k = torch.cat([kv_heads[..., :m.qk_nope_head_dim],
                       every[:, None, m.kv_lora_rank:].expand(s, heads, m.qk_rope_head_dim)], dim=-1)  # [S, H, nope + r]
        v = kv_heads[..., m.qk_nope_head_dim:]  # [S, H, v]
        q = torch.cat([q[..., :m.qk_nope_head_dim], q_pe], dim=-1)  # [T, H, nope + r]
        q = q * yarn_softmax_factor(c.rope_scaling)   # attention() divides by sqrt(nope + r)
        out = self.store(attention(q, k, v, visible, probs_store=self.probs_store))  # [T, H, v]
        return self._linear(out.reshape(t, heads * m.v_head_dim), p + "o_proj"), latent, latent

    def _swiglu(self, prefix: str, x: Tensor) -> Tensor:
        """down(silu(gate(x)) * up(x)) of the projections under `prefix`: [N, hidden] -> [N, hidden]."""
        gate = torch.nn.functional.silu(self._linear(x, prefix + "gate_proj"))
        return self._linear(self.store(gate * self._linear(x, prefix + "up_proj")), prefix + "down_proj")

    def _mlp(self, layer: int, x: Tensor) -> Tensor:
        moe, p = self.config.moe, f"model.layers.{layer}.mlp."
        if moe is None or not moe.is_moe_layer(layer):
            return self._swiglu(p, x)
        logits = x @ self._weight(p + "gate.weight").T  # [T, E], the router's logits unrounded
        selection = select_experts(logits, self.w[p + "gate.e_score_correction_bias"], moe)
        if self._route_sink is not None:
            self._route_sink.append(selection)
        shared = (lambda h: self._swiglu(p + "shared_experts.", h)) if moe.n_shared_experts else None
        return self.store(combine(x, selection, lambda e, h: self._swiglu(p + f"experts.{e}.", h), shared))


def moe_layers(config: ModelConfig) -> tuple[int, ...]:
    """The layers whose MLP is a mixture of experts, in order."""
    if config.moe is None:
        return ()
    return tuple(i for i in range(config.num_layers) if config.moe.is_moe_layer(i))


def latent_width(config: ModelConfig) -> int:
    """kv_lora_rank + qk_rope_head_dim: one cached latent's width."""
    return config.mla.kv_lora_rank + config.mla.qk_rope_head_dim

