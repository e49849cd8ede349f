"""The oracle's own names for a checkpoint's tensors (Hugging Face's naming),
read from nothing of the harness's: a wrong name in the shared schema
(ddschema.config.weight_names, which the engine's loader and the random
presets use) then reaches one side only, and shows as a load divergence
instead of a KeyError of both.

Names, and the MLA and MoE tensors' shapes the config implies: which tensors a model of `cfg` computes
with, and how big they must be. The math stays in reference/model.py."""
from __future__ import annotations

from ddschema.config import ModelConfig

SWIGLU = ("gate_proj", "up_proj", "down_proj")


def weight_names(cfg: ModelConfig) -> list[str]:
    """Every tensor the oracle reads for a model of `cfg`."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if cfg.sandwich_norms:
            names += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
        names += _attention(cfg, p + "self_attn.")
        if cfg.qkv_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if cfg.o_bias:
            names.append(p + "self_attn.o_proj.bias")
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if cfg.attn_sinks:
            names.append(p + "self_attn.sinks")
        names += _mlp(cfg, p + "mlp.", i)
    return names


def _attention(cfg: ModelConfig, a: str) -> list[str]:
    if cfg.mla is None:
        return [a + f"{proj}.weight" for proj in ("q_proj", "k_proj", "v_proj", "o_proj")]
    q = ([a + "q_proj.weight"] if cfg.mla.q_lora_rank is None
         else [a + "q_a_proj.weight", a + "q_a_layernorm.weight", a + "q_b_proj.weight"])
    return q + [a + "kv_a_proj_with_mqa.weight", a + "kv_a_layernorm.weight", a + "kv_b_proj.weight",
                a + "o_proj.weight"]


def _mlp(cfg: ModelConfig, m: str, layer: int) -> list[str]:
    if cfg.moe is None or not cfg.moe.is_moe_layer(layer):
        return [m + f"{proj}.weight" for proj in SWIGLU]
    names = [m + "gate.weight", m + "gate.e_score_correction_bias"]
    for e in range(cfg.moe.n_routed_experts):
        names += [m + f"experts.{e}.{proj}.weight" for proj in SWIGLU]
    if cfg.moe.n_shared_experts:
        names += [m + f"shared_experts.{proj}.weight" for proj in SWIGLU]
    return names


def mla_moe_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shapes the oracle expects of the MLA and MoE tensors of weight_names(cfg), derived here from the
    config on its own ([out, in] for projections; the Llama-family shapes are checked where they are used,
    in reference/model.py): a wrong shape in the shared schema then reaches the engine's side alone."""
    out: dict[str, tuple[int, ...]] = {}
    hidden = cfg.hidden_size
    for layer in range(cfg.num_layers):
        if cfg.mla is not None:
            out.update(_mla_shapes(cfg, f"model.layers.{layer}.self_attn.", hidden))
        if cfg.moe is not None and cfg.moe.is_moe_layer(layer):
            out.update(_moe_shapes(cfg, f"model.layers.{layer}.mlp.", hidden))
    return out


def _mla_shapes(cfg: ModelConfig, a: str, hidden: int) -> dict[str, tuple[int, ...]]:
    m, heads = cfg.mla, cfg.num_heads
    q_out = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)   # each head's query: a plain and a rotated part
    if m.q_lora_rank is None:
        q = {a + "q_proj.weight": (q_out, hidden)}
    else:
        q = {a + "q_a_proj.weight": (m.q_lora_rank, hidden), a + "q_a_layernorm.weight": (m.q_lora_rank,),
             a + "q_b_proj.weight": (q_out, m.q_lora_rank)}
    return {**q,
            a + "kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, hidden),   # latent + rope key
            a + "kv_a_layernorm.weight": (m.kv_lora_rank,),
            a + "kv_b_proj.weight": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
            a + "o_proj.weight": (hidden, heads * m.v_head_dim)}


def _moe_shapes(cfg: ModelConfig, mp: str, hidden: int) -> dict[str, tuple[int, ...]]:
    moe = cfg.moe
    out = {mp + "gate.weight": (moe.n_routed_experts, hidden), mp + "gate.e_score_correction_bias": (moe.n_routed_experts,)}
    widths = {f"experts.{e}.": moe.moe_intermediate_size for e in range(moe.n_routed_experts)}
    if moe.n_shared_experts:   # the shared experts are one MLP as wide as all of them together
        widths["shared_experts."] = moe.moe_intermediate_size * moe.n_shared_experts
    for ex, width in widths.items():
        out |= {mp + ex + "gate_proj.weight": (width, hidden), mp + ex + "up_proj.weight": (width, hidden),
                mp + ex + "down_proj.weight": (hidden, width)}
    return out
