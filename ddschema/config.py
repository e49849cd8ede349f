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


@dataclass(frozen=True)
class YarnScaling:
    """DeepSeek-V3's YaRN RoPE scaling (`rope_scaling.type` "yarn"): rotary
    dimensions whose wavelength is short against `original_max_position`
    (more than `beta_fast` turns) keep their frequency, long ones (fewer than
    `beta_slow` turns) are divided by `factor`, a linear ramp between; cos and
    sin are multiplied by mscale(factor, mscale) / mscale(factor,
    mscale_all_dim), and the attention scale by mscale(factor,
    mscale_all_dim)**2, where mscale(s, m) = 0.1 * m * ln(s) + 1 for s > 1.
    Only the numbers live here; each side implements the math on its own."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        if not self.factor > 0 or not self.original_max_position >= 1:
            raise ValueError("yarn scaling needs factor > 0 and original_max_position >= 1")
        if not 0 < self.beta_slow <= self.beta_fast:
            raise ValueError("yarn scaling needs 0 < beta_slow <= beta_fast")


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): queries through a
    LoRA `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` (or one `q_proj` when
    `q_lora_rank` is None); keys and values from one compressed latent per
    token, `kv_a_proj_with_mqa` giving kv_lora_rank + qk_rope_head_dim columns
    (the latent, normed by `kv_a_layernorm`, and one RoPE key shared by every
    head), `kv_b_proj` expanding the latent into per-head no-RoPE keys
    (qk_nope_head_dim) and values (v_head_dim). A query head is
    qk_nope_head_dim + qk_rope_head_dim wide, scores scaled by that width's
    -0.5 power (times YaRN's correction). The RoPE part is stored interleaved
    (pairs 2i, 2i+1), as DeepSeek's checkpoints are."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"MlaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"MlaConfig.q_lora_rank must be >= 1 or None, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError("MlaConfig.qk_rope_head_dim must be even for RoPE")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoeConfig:
    """DeepSeek-V3's mixture of experts: layers from `first_k_dense_replace`
    on replace the MLP by `n_routed_experts` SwiGLU experts of width
    `moe_intermediate_size` plus `n_shared_experts` shared ones (one SwiGLU of
    width moe_intermediate_size * n_shared_experts, always on). The router
    (`mlp.gate.weight`, [n_routed_experts, hidden]) scores each token with a
    sigmoid; `mlp.gate.e_score_correction_bias` is added for choosing only:
    experts fall in `n_group` groups, a group scores the sum of its top two
    biased scores, the `topk_group` best groups stay, and the
    `num_experts_per_tok` best biased experts in them are picked. Their
    weights are the unbiased scores, divided by their sum if `norm_topk_prob`,
    times `routed_scaling_factor`."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    scoring_func: str = "sigmoid"

    def __post_init__(self) -> None:
        for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoeConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_shared_experts < 0 or self.first_k_dense_replace < 0:
            raise ValueError("MoeConfig.n_shared_experts and first_k_dense_replace must be >= 0")
        if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError("MoeConfig: n_group must divide n_routed_experts and topk_group <= n_group")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ValueError("MoeConfig: num_experts_per_tok exceeds the experts of the topk_group groups")
        if self.scoring_func != "sigmoid":
            raise ValueError(f"MoeConfig.scoring_func must be 'sigmoid', got {self.scoring_func!r}")

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


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

    DeepSeek-V3 / Kimi K2 (DeepseekV3ForCausalLM) set `mla` (attention from a
    compressed latent; num_kv_heads == num_heads and head_dim ==
    mla.qk_head_dim then) and `moe` (routed and shared experts from layer
    moe.first_k_dense_replace on; `intermediate_size` is the dense layers'),
    usually with a YarnScaling.
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
    rope_scaling: RopeScaling | YarnScaling | None = None
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
    mla: MlaConfig | None = None
    moe: MoeConfig | None = None

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
        if self.mla is not None and (self.num_kv_heads != self.num_heads or self.head_dim != self.mla.qk_head_dim):
            raise ValueError("an MLA config has num_kv_heads == num_heads and head_dim == qk_nope + qk_rope")
        if self.moe is not None and self.moe.first_k_dense_replace > self.num_layers:
            raise ValueError("MoeConfig.first_k_dense_replace exceeds num_layers")
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
        names += _attention_names(cfg, p)
        if cfg.qkv_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if cfg.o_bias:
            names.append(p + "self_attn.o_proj.bias")
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if cfg.attn_sinks:
            names.append(p + "self_attn.sinks")
        names += _mlp_names(cfg, p, i)
    return names


def _attention_names(cfg: ModelConfig, p: str) -> list[str]:
    if cfg.mla is None:
        return [p + f"self_attn.{proj}.weight" for proj in ("q_proj", "k_proj", "v_proj", "o_proj")]
    a = p + "self_attn."
    q = ([a + "q_proj.weight"] if cfg.mla.q_lora_rank is None
         else [a + "q_a_proj.weight", a + "q_a_layernorm.weight", a + "q_b_proj.weight"])
    return q + [a + "kv_a_proj_with_mqa.weight", a + "kv_a_layernorm.weight", a + "kv_b_proj.weight",
                a + "o_proj.weight"]


def _mlp_names(cfg: ModelConfig, p: str, layer: int) -> list[str]:
    swiglu = ("gate_proj", "up_proj", "down_proj")
    if cfg.moe is None or not cfg.moe.is_moe_layer(layer):
        return [p + f"mlp.{proj}.weight" for proj in swiglu]
    names = [p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias"]
    for e in range(cfg.moe.n_routed_experts):
        names += [p + f"mlp.experts.{e}.{proj}.weight" for proj in swiglu]
    if cfg.moe.n_shared_experts:
        names += [p + f"mlp.shared_experts.{proj}.weight" for proj in swiglu]
    return names


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The checkpoint shapes of the MLA and MoE tensors of weight_names(cfg)
    ([out, in] for projections): a layout, not math. The Llama-family tensors
    are not listed; each side derives their shapes on its own."""
    shapes: dict[str, tuple[int, ...]] = {}
    h = cfg.hidden_size
    for i in range(cfg.num_layers):
        a = f"model.layers.{i}.self_attn."
        if cfg.mla is not None:
            m, n = cfg.mla, cfg.num_heads
            if m.q_lora_rank is None:
                shapes[a + "q_proj.weight"] = (n * m.qk_head_dim, h)
            else:
                shapes[a + "q_a_proj.weight"] = (m.q_lora_rank, h)
                shapes[a + "q_a_layernorm.weight"] = (m.q_lora_rank,)
                shapes[a + "q_b_proj.weight"] = (n * m.qk_head_dim, m.q_lora_rank)
            shapes[a + "kv_a_proj_with_mqa.weight"] = (m.kv_lora_rank + m.qk_rope_head_dim, h)
            shapes[a + "kv_a_layernorm.weight"] = (m.kv_lora_rank,)
            shapes[a + "kv_b_proj.weight"] = (n * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
            shapes[a + "o_proj.weight"] = (h, n * m.v_head_dim)
        if cfg.moe is not None and cfg.moe.is_moe_layer(i):
            e, w, mp = cfg.moe.n_routed_experts, cfg.moe.moe_intermediate_size, f"model.layers.{i}.mlp."
            shapes[mp + "gate.weight"] = (e, h)
            shapes[mp + "gate.e_score_correction_bias"] = (e,)
            experts = [f"experts.{j}." for j in range(e)] + (["shared_experts."] if cfg.moe.n_shared_experts else [])
            for ex in experts:
                width = w * cfg.moe.n_shared_experts if ex == "shared_experts." else w
                shapes[mp + ex + "gate_proj.weight"] = (width, h)
                shapes[mp + ex + "up_proj.weight"] = (width, h)
                shapes[mp + ex + "down_proj.weight"] = (h, width)
    return shapes
