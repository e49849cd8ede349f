"""Model configuration and the Hugging Face weight names both sides read."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's frequency-dependent RoPE scaling (`rope_type` "llama3"):
    wavelengths longer than original_max_position / low_freq_factor are
    stretched by `factor`, shorter than original_max_position /
    high_freq_factor are kept, and the band between is interpolated. Only the
    numbers live here; each side implements the math on its own."""

    rope_type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int

    def __post_init__(self) -> None:
        if self.rope_type != "llama3":
            raise ValueError(f"RopeScaling supports rope_type 'llama3' only, got {self.rope_type!r}")
        if not self.factor > 0 or not self.original_max_position >= 1:
            raise ValueError("rope scaling needs factor > 0 and original_max_position >= 1")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError("rope scaling needs 0 < low_freq_factor < high_freq_factor")


# the MLP gate's activation, by Hugging Face's name: SwiGLU's SiLU, Gemma's tanh-approximated GELU
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder: RMSNorm, RoPE, GQA, SwiGLU.

    `qkv_bias` is Qwen2's bias on q/k/v projections; `o_bias` a bias on
    o_proj too (Llama's and Qwen3's `attention_bias` sets both); `qk_norm` is
    Qwen3's per-head RMSNorm on q and k before RoPE; `rope_scaling` None is
    plain RoPE. `attn_logit_softcap` c (Gemma 2's `attn_logit_softcapping`)
    maps every scaled attention score s to c * tanh(s / c) before the mask;
    `attn_sinks` gives each layer a learned sink logit per query head
    (gpt-oss's `self_attn.sinks`, [num_heads]): one more term exp(sink) in
    the softmax's denominator, with no value.

    `sliding_window` W (Hugging Face's convention, the query itself
    included): on the layers in `sliding_layers`, a query at position q sees a
    key at position k only if q - k < W (and causality holds); None with no
    sliding layers is full attention everywhere. Mistral windows every layer,
    Qwen2/Qwen3 the layers from `max_window_layers` on, Gemma-style configs
    list `layer_types`; each side reads those keys on its own.

    Gemma 3 (Gemma3ForCausalLM) sets the rest, each side computing it on its own:
    `norm_plus_one`, every RMSNorm scales by (1 + weight); `sandwich_norms`,
    `post_attention_layernorm` normalizes the attention's output before the
    residual add and `pre_feedforward_layernorm` / `post_feedforward_layernorm`
    wrap the MLP; `hidden_act` "gelu_pytorch_tanh", the MLP's gate goes through
    tanh-approximated GELU instead of SiLU; `embed_scale`, the embedding rows
    are multiplied by it (Gemma: sqrt(hidden_size)); `query_pre_attn_scalar` s,
    attention scores are scaled by s**-0.5 instead of head_dim**-0.5;
    `rope_local_theta`, the RoPE base of the sliding layers (Gemma 3's
    `rope_local_base_freq`; they take no `rope_scaling`), None: rope_theta
    (and rope_scaling) on every layer; `final_logit_softcap` c, each output
    logit x becomes c * tanh(x / c).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position: int = 4096
    o_bias: bool = False
    rope_scaling: RopeScaling | None = None
    attn_logit_softcap: float | None = None
    attn_sinks: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    hidden_act: str = "silu"
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None
    final_logit_softcap: float | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads (GQA)")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")
        if self.attn_logit_softcap is not None and not 0 < self.attn_logit_softcap < float("inf"):
            raise ValueError(f"attn_logit_softcap must be a positive number, got {self.attn_logit_softcap}")
        if (self.sliding_window is None) != (not self.sliding_layers):
            raise ValueError("sliding_window and sliding_layers are set together (a window needs its layers)")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool)
                                                or not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer, got {self.sliding_window!r}")
        layers = self.sliding_layers
        if tuple(sorted(set(layers))) != tuple(layers) or any(not 0 <= i < self.num_layers for i in layers):
            raise ValueError(f"sliding_layers must be distinct layer indices in [0, {self.num_layers}) in order")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {', '.join(HIDDEN_ACTS)}, got {self.hidden_act!r}")
        for name in ("embed_scale", "query_pre_attn_scalar", "rope_local_theta", "final_logit_softcap"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
                raise ValueError(f"ModelConfig.{name} must be a positive number, got {v!r}")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer`, None for a full-attention layer."""
        return self.sliding_window if layer in self.sliding_layers else None


def weight_names(cfg: ModelConfig) -> list[str]:
    """Every tensor name a checkpoint of `cfg` holds, in Hugging Face's naming."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if cfg.sandwich_norms:
            names += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.append(p + f"self_attn.{proj}.weight")
        if cfg.qkv_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if cfg.o_bias:
            names.append(p + "self_attn.o_proj.bias")
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if cfg.attn_sinks:
            names.append(p + "self_attn.sinks")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.append(p + f"mlp.{proj}.weight")
    return names
