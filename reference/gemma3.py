"""The oracle's own reading of Gemma 3's text decoder (Gemma3ForCausalLM,
model_type gemma3_text) and the few pieces of its math that Llama lacks.

Config, as transformers' Gemma3TextConfig builds it from config.json (a key
left out takes its default there):
  * layer kinds: `layer_types`, else `sliding_window_pattern` N, under which
    layer i is full attention exactly when (i + 1) is a multiple of N;
  * RoPE: full layers rotate with `rope_theta` (and `rope_scaling`), sliding
    layers with `rope_local_base_freq` and no scaling; transformers 5 writes
    both as `rope_parameters[layer type]`;
  * attention scores are scaled by query_pre_attn_scalar ** -0.5;
  * embeddings are multiplied by sqrt(hidden_size);
  * every RMSNorm (q/k norms and the four per layer) scales by (1 + weight);
  * MLP: down(gelu_tanh(gate(x)) * up(x));
  * final_logit_softcapping c: logits c * tanh(logits / c).
Only default (unscaled) RoPE is implemented for Gemma 3: anything else is
refused (CheckpointRefused), as is non-causal attention.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ddschema.config import ModelConfig
from reference.own_config import own_config

GEMMA3 = "Gemma3ForCausalLM"
GEMMA3_DEFAULTS = dict(head_dim=256, rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=131072,
                       hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096,
                       sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=1e4)


def gemma_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x * rsqrt(mean(x^2 over the last dim) + eps) * (1 + weight)."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * (1.0 + weight)


def gelu_tanh(x: Tensor) -> Tensor:
    """0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), written out in float64."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def soft_cap(x: Tensor, cap: float | None) -> Tensor:
    """cap * tanh(x / cap); x itself when cap is None."""
    return x if cap is None else cap * torch.tanh(x / cap)


def layer_rope(config: ModelConfig, layer: int) -> tuple[float, object]:
    """(RoPE base, scaling) that `layer` rotates with."""
    if config.rope_local_theta is not None and layer in config.sliding_layers:
        return config.rope_local_theta, None
    return config.rope_theta, config.rope_scaling


def _positive(value, what: str, refuse) -> float | None:
    if value is None:
        return None
    if type(value) not in (int, float) or not (value > 0 and math.isfinite(value)):
        raise refuse(f"{what} must be a positive number, got {value!r}")
    return float(value)


def _layer_kinds(hf: dict, n: int, refuse) -> list[str]:
    if hf.get("layer_types") is not None:
        kinds = hf["layer_types"]
        if type(kinds) is not list or len(kinds) != n:
            raise refuse(f"layer_types must list {n} layer kinds")
        for kind in kinds:
            if kind not in ("full_attention", "sliding_attention"):
                raise refuse(f"layer type {kind!r} is not supported (full_attention and sliding_attention are)")
        return kinds
    pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern",
                                                      GEMMA3_DEFAULTS["sliding_window_pattern"]))
    if type(pattern) is not int or pattern <= 0:
        raise refuse(f"sliding_window_pattern {pattern!r} is not a positive layer count")
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]


def _rope_bases(hf: dict, refuse) -> tuple[float, float]:
    """(full layers' base, sliding layers' base); refuses any RoPE but the default."""
    nested = hf.get("rope_parameters")
    if isinstance(nested, dict) and ({"full_attention", "sliding_attention"} & set(nested)):
        parts = {"full": dict(nested.get("full_attention") or {"rope_theta": GEMMA3_DEFAULTS["rope_theta"]}),
                 "sliding": dict(nested.get("sliding_attention")
                                 or {"rope_theta": GEMMA3_DEFAULTS["rope_local_base_freq"]})}
    else:
        full = {"rope_theta": hf.get("rope_theta", GEMMA3_DEFAULTS["rope_theta"])}
        full.update(hf.get("rope_scaling") or {})
        full.update(nested or {})
        parts = {"full": full,
                 "sliding": {"rope_theta": hf.get("rope_local_base_freq", GEMMA3_DEFAULTS["rope_local_base_freq"])}}
    bases = []
    for where in ("full", "sliding"):
        p = parts[where]
        kind = p.get("rope_type", p.get("type", "default"))
        if kind != "default":
            raise refuse(f"rope type {kind!r} on Gemma 3's {where}-attention layers is not supported (default is)")
        if float(p.get("partial_rotary_factor", 1.0)) != 1.0:
            raise refuse("partial_rotary_factor != 1 (partial RoPE) is not supported")
        bases.append(_positive(p.get("rope_theta"), f"the {where} layers' rope_theta", refuse))
    return bases[0], bases[1]


def read_gemma3_config(hf: dict, refuse) -> ModelConfig:
    """A Gemma 3 text config.json (parsed) -> ModelConfig; `refuse` is the
    exception class to raise (one line) for what is unsupported or invalid."""
    def get(key):
        return hf.get(key, GEMMA3_DEFAULTS.get(key))
    act = get("hidden_activation")
    if act not in ("gelu_pytorch_tanh", "silu"):
        raise refuse(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh and silu are)")
    if hf.get("use_bidirectional_attention"):
        raise refuse("use_bidirectional_attention (non-causal attention) is not supported")
    try:
        n, heads, hidden = int(hf["num_hidden_layers"]), int(hf["num_attention_heads"]), int(hf["hidden_size"])
    except KeyError as e:
        raise refuse(f"config.json lacks {e}") from None
    kinds = _layer_kinds(hf, n, refuse)
    sliding = tuple(i for i in range(n) if kinds[i] == "sliding_attention")
    window = get("sliding_window") if sliding else None
    if sliding and (type(window) is not int or window <= 0):
        raise refuse(f"sliding_window {window!r} is not a positive window length")
    full_base, local_base = _rope_bases(hf, refuse)
    bias = bool(hf.get("attention_bias", False))
    try:
        return own_config(
            vocab_size=int(hf["vocab_size"]), hidden_size=hidden, intermediate_size=int(hf["intermediate_size"]),
            num_layers=n, num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or GEMMA3_DEFAULTS["head_dim"]), rope_theta=full_base,
            rms_norm_eps=_positive(get("rms_norm_eps"), "rms_norm_eps", refuse), qkv_bias=bias, o_bias=bias,
            qk_norm=True, tie_word_embeddings=bool(get("tie_word_embeddings")),
            max_position=int(hf.get("max_position_embeddings") or GEMMA3_DEFAULTS["max_position_embeddings"]),
            attn_logit_softcap=_positive(hf.get("attn_logit_softcapping"), "attn_logit_softcapping", refuse),
            sliding_window=window, sliding_layers=sliding, hidden_act=act, norm_plus_one=True,
            sandwich_norms=True, embed_scale=math.sqrt(hidden),
            query_pre_attn_scalar=_positive(get("query_pre_attn_scalar"), "query_pre_attn_scalar", refuse),
            rope_local_theta=local_base if sliding else None,
            final_logit_softcap=_positive(hf.get("final_logit_softcapping"), "final_logit_softcapping", refuse))
    except KeyError as e:
        raise refuse(f"config.json lacks {e}") from None
    except (TypeError, ValueError) as e:
        raise refuse(f"config.json describes no valid model: {e}") from None
