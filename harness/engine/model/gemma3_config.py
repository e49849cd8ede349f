"""config.json -> ModelConfig for Gemma 3's text decoder (Gemma3ForCausalLM,
model_type gemma3_text), on the engine's side. A key absent from config.json
takes transformers' Gemma3TextConfig default (the model Hugging Face would
build from the same file); every key that changes the math and is not
implemented is a one-line refusal (ModelLoadError, exit 2).

Both spellings of RoPE are read: transformers 4's `rope_theta` (full layers),
`rope_local_base_freq` (sliding layers) and `rope_scaling`, and transformers
5's `rope_parameters` keyed by layer type. Which layers slide: `layer_types`,
else `sliding_window_pattern` N (every N-th layer is full, the others slide).

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import math

from ddschema import ModelConfig

ARCHITECTURE = "Gemma3ForCausalLM"
# transformers' Gemma3TextConfig defaults, for keys config.json leaves out
DEFAULTS = {"head_dim": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
            "max_position_embeddings": 131072, "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
            "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
ACTIVATIONS = ("gelu_pytorch_tanh", "silu")


class Gemma3ConfigError(ValueError):
    """A Gemma 3 config.json the engine does not implement (hf_config turns it into ModelLoadError)."""


def _number(hf: dict, key: str, positive: bool = True) -> float | None:
    v = hf.get(key, DEFAULTS.get(key))
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (positive and not 0 < v < math.inf):
        raise Gemma3ConfigError(f"config.json: {key} must be a positive number, got {v!r}")
    return float(v)


def _sliding_layers(hf: dict, layers: int) -> tuple[int, ...]:
    kinds = hf.get("layer_types")
    if kinds is not None:
        if not isinstance(kinds, list) or any(k not in ("full_attention", "sliding_attention") for k in kinds):
            raise Gemma3ConfigError(f"config.json sets layer_types {kinds!r} (only full_attention and "
                                    "sliding_attention), which is not supported")
        if len(kinds) != layers:
            raise Gemma3ConfigError(f"config.json: layer_types lists {len(kinds)} layers, num_hidden_layers "
                                    f"is {layers}")
        return tuple(i for i, k in enumerate(kinds) if k == "sliding_attention")
    every = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", DEFAULTS["sliding_window_pattern"]))
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise Gemma3ConfigError(f"config.json: sliding_window_pattern must be a positive integer, got {every!r}")
    return tuple(i for i in range(layers) if (i + 1) % every)


def _rope_part(params: dict, where: str) -> float:
    """The base of one layer type's RoPE; only unscaled ("default") RoPE is implemented."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise Gemma3ConfigError(f"config.json sets rope type {kind!r} on Gemma 3's {where} layers, which "
                                "changes the math and is not supported (default only)")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise Gemma3ConfigError(f"config.json sets partial_rotary_factor on Gemma 3's {where} layers, which "
                                "is not supported")
    theta = params.get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
        raise Gemma3ConfigError(f"config.json: Gemma 3's {where} rope_theta must be a positive number, got {theta!r}")
    return float(theta)


def _rope(hf: dict) -> tuple[float, float]:
    """(full layers' base, sliding layers' base)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full = params.get("full_attention") or {"rope_theta": DEFAULTS["rope_theta"]}
        local = params.get("sliding_attention") or {"rope_theta": DEFAULTS["rope_local_base_freq"]}
        return _rope_part(full, "full"), _rope_part(local, "sliding")
    full = {"rope_theta": hf.get("rope_theta", DEFAULTS["rope_theta"]), **(hf.get("rope_scaling") or {}),
            **(params or {})}
    local = {"rope_theta": hf.get("rope_local_base_freq", DEFAULTS["rope_local_base_freq"])}
    return _rope_part(full, "full"), _rope_part(local, "sliding")


def gemma3_config(hf: dict) -> ModelConfig:
    """ModelConfig of a Gemma 3 text config.json; Gemma3ConfigError (one line) for
    what is not implemented or impossible, KeyError for a missing size."""
    act = hf.get("hidden_activation", DEFAULTS["hidden_activation"])
    if act not in ACTIVATIONS:
        raise Gemma3ConfigError(f"config.json sets hidden_activation {act!r} (only {' and '.join(ACTIVATIONS)}), "
                                "which changes the math and is not supported")
    if hf.get("use_bidirectional_attention"):
        raise Gemma3ConfigError("config.json sets use_bidirectional_attention (non-causal attention), which "
                                "is not supported")
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    sliding = _sliding_layers(hf, layers)
    window = hf.get("sliding_window", DEFAULTS["sliding_window"]) if sliding else None
    if sliding and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise Gemma3ConfigError(f"config.json: sliding layers with sliding_window {window!r} (not a positive "
                                "integer) are not supported")
    full_theta, local_theta = _rope(hf)
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_layers=layers, num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or DEFAULTS["head_dim"], rope_theta=full_theta,
        rms_norm_eps=_number(hf, "rms_norm_eps"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", DEFAULTS["tie_word_embeddings"])),
        max_position=hf.get("max_position_embeddings") or DEFAULTS["max_position_embeddings"],
        qkv_bias=bias, o_bias=bias, qk_norm=True,
        attn_logit_softcap=_number(hf, "attn_logit_softcapping"), sliding_window=window, sliding_layers=sliding,
        hidden_act=act, norm_plus_one=True, sandwich_norms=True, embed_scale=math.sqrt(hf["hidden_size"]),
        query_pre_attn_scalar=_number(hf, "query_pre_attn_scalar"),
        rope_local_theta=local_theta if sliding else None,
        final_logit_softcap=_number(hf, "final_logit_softcapping"))
