"""config.json <-> ModelConfig on the engine's side: which Hugging Face keys
the engine implements, and a one-line refusal (ModelLoadError, exit 2) for
every key that would change the math and that it does not implement.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import math

from ddschema import ModelConfig, RopeScaling
from harness.engine.model.deepseek_config import ARCHITECTURE as DEEPSEEK_V3, DeepseekConfigError, deepseek_config, \
    deepseek_to_hf
from harness.engine.model.gemma3_config import ARCHITECTURE as GEMMA3, Gemma3ConfigError, gemma3_config


class ModelLoadError(ValueError):
    """A preset or checkpoint that cannot be loaded (a usage error)."""


# architecture -> flags it implies, whether it reads `attention_bias`, HF's max_position_embeddings default
SUPPORTED_ARCHS = {"LlamaForCausalLM": ({}, True, 2048),
                   "Qwen2ForCausalLM": ({"qkv_bias": True}, False, 32768),
                   "Qwen3ForCausalLM": ({"qk_norm": True}, True, 32768),
                   "MistralForCausalLM": ({}, False, 32768)}
LAYER_TYPES = ("full_attention", "sliding_attention")
QWEN2_MAX_WINDOW_LAYERS = 28   # transformers' Qwen2Config / Qwen3Config default

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _refusals(hf: dict, arch: str) -> list[str]:
    """Every math-changing key present that the engine does not implement."""
    found = []
    if hf.get("hidden_act", "silu") != "silu":
        found.append(f"hidden_act {hf['hidden_act']!r} (only silu)")
    if hf.get("mlp_bias"):
        found.append("mlp_bias")
    if hf.get("final_logit_softcapping") is not None:
        found.append("final_logit_softcapping (soft-capping of the output logits)")
    if arch == "LlamaForCausalLM" and (hf.get("sliding_window") is not None
                                       or "sliding_attention" in (hf.get("layer_types") or ())):
        found.append("sliding_window on LlamaForCausalLM (its Hugging Face model has no window; "
                     "MistralForCausalLM, Qwen2 and Qwen3 have)")
    kinds = hf.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list) or any(k not in LAYER_TYPES for k in kinds)):
        found.append(f"layer_types {kinds!r} (only {' and '.join(LAYER_TYPES)})")
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        found.append(f"partial_rotary_factor {partial}")
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in ("default", "llama3"):
        found.append(f"rope type {kind!r} (default and llama3 only)")
    return found


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    if (rope.get("rope_type") or rope.get("type") or "default") == "default":
        return theta, None
    absent = [k for k in LLAMA3_KEYS if k not in rope]
    if absent:
        raise ModelLoadError(f"llama3 rope scaling lacks {', '.join(absent)}")
    return theta, RopeScaling("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                              float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))


def _window(hf: dict, arch: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(sliding_window, the layers it applies to): an explicit `layer_types`
    list decides the layers; else Mistral windows every layer and Qwen2/Qwen3
    (with use_sliding_window) the layers from max_window_layers on."""
    kinds = hf.get("layer_types")
    if kinds is not None:
        if len(kinds) != num_layers:
            raise ModelLoadError(f"config.json: layer_types lists {len(kinds)} layers, num_hidden_layers is {num_layers}")
        layers = tuple(i for i, k in enumerate(kinds) if k == "sliding_attention")
    elif arch == "MistralForCausalLM":
        layers = tuple(range(num_layers)) if hf.get("sliding_window") is not None else ()
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and hf.get("use_sliding_window"):
        first = hf.get("max_window_layers", QWEN2_MAX_WINDOW_LAYERS)
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise ModelLoadError(f"config.json: max_window_layers must be an integer >= 0, got {first!r}")
        layers = tuple(range(first, num_layers))
    else:
        layers = ()
    if not layers:
        return None, ()
    w = hf.get("sliding_window")
    if not isinstance(w, int) or isinstance(w, bool) or w < 1:
        raise ModelLoadError(f"config.json: sliding layers with sliding_window {w!r} (not a positive integer) "
                             "are not supported")
    return w, layers


SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
OPTIONAL_SIZE_KEYS = ("num_key_value_heads", "head_dim", "max_position_embeddings")


def _check_sizes(hf: dict) -> None:
    """Sizes are positive integers and the head layout divides, before anything
    divides by them (issue 12: num_attention_heads 0 ended in ZeroDivisionError)."""
    for key in SIZE_KEYS + OPTIONAL_SIZE_KEYS:
        if key not in hf or (key in OPTIONAL_SIZE_KEYS and hf[key] is None):
            continue
        v = hf[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ModelLoadError(f"config.json: {key} must be a positive integer, got {v!r}")
    for key in ("rms_norm_eps", "rope_theta"):
        v = hf.get(key)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf")):
            raise ModelLoadError(f"config.json: {key} must be a positive number, got {v!r}")
    if "head_dim" not in hf and "hidden_size" in hf and "num_attention_heads" in hf \
            and hf["hidden_size"] % hf["num_attention_heads"]:
        raise ModelLoadError(f"config.json: hidden_size {hf['hidden_size']} is not a multiple of "
                             f"num_attention_heads {hf['num_attention_heads']} (and no head_dim is given)")


def config_from_hf(hf: dict) -> ModelConfig:
    """Raises ModelLoadError for an unsupported architecture, a math-changing
    key the engine does not implement or impossible values, KeyError for a
    missing field."""
    if not isinstance(hf, dict):
        raise ModelLoadError(f"config.json holds a {type(hf).__name__}, not an object")
    arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch == GEMMA3:
        _check_sizes(hf)
        try:
            return gemma3_config(hf)
        except (Gemma3ConfigError, TypeError, ValueError) as e:
            raise ModelLoadError(str(e) if isinstance(e, Gemma3ConfigError)
                                 else f"config.json describes no valid model: {e}") from None
    if arch == DEEPSEEK_V3:
        _check_sizes(hf)
        try:
            return deepseek_config(hf)
        except (DeepseekConfigError, TypeError, ValueError) as e:
            raise ModelLoadError(str(e) if isinstance(e, DeepseekConfigError)
                                 else f"config.json describes no valid model: {e}") from None
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"unsupported architecture {arch!r}; supported: "
                             f"{', '.join([*SUPPORTED_ARCHS, GEMMA3, DEEPSEEK_V3])}")
    refused = _refusals(hf, arch)
    if refused:
        raise ModelLoadError(f"config.json sets {refused[0]}, which changes the math and is not supported")
    implied, reads_bias, max_default = SUPPORTED_ARCHS[arch]
    flags = dict(implied)
    if reads_bias and hf.get("attention_bias"):
        flags.update(qkv_bias=True, o_bias=True)  # Llama and Qwen3: bias on q, k, v and o
    _check_sizes(hf)
    cap = hf.get("attn_logit_softcapping")
    if cap is not None and (not isinstance(cap, (int, float)) or isinstance(cap, bool) or not 0 < cap < float("inf")):
        raise ModelLoadError(f"config.json: attn_logit_softcapping must be a positive number, got {cap!r}")
    heads = hf["num_attention_heads"]
    theta, scaling = _rope(hf)
    window, sliding = _window(hf, arch, hf["num_hidden_layers"])
    fields = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, rope_theta=theta,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position=hf.get("max_position_embeddings") or max_default, rope_scaling=scaling,
        attn_logit_softcap=None if cap is None else float(cap), sliding_window=window,
        sliding_layers=sliding, **flags)
    try:
        return ModelConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"config.json describes no valid model: {e}") from None


def config_to_hf(cfg: ModelConfig) -> dict:
    """The config.json a Hugging Face checkpoint of `cfg` carries (what
    config_from_hf reads back as `cfg`)."""
    if cfg.norm_plus_one:
        return gemma3_to_hf(cfg)
    if cfg.mla is not None:
        try:
            return deepseek_to_hf(cfg)
        except DeepseekConfigError as e:
            raise ModelLoadError(str(e)) from None
    if cfg.qk_norm:
        arch = "Qwen3ForCausalLM"
    elif cfg.qkv_bias and not cfg.o_bias:
        arch = "Qwen2ForCausalLM"
    elif cfg.sliding_window is not None:
        arch = "MistralForCausalLM"
    else:
        arch = "LlamaForCausalLM"
    if arch == "MistralForCausalLM" and cfg.o_bias:
        raise ModelLoadError("MistralForCausalLM (a Llama-layout model with a window) has no attention bias")
    if cfg.o_bias != (cfg.qkv_bias and arch != "Qwen2ForCausalLM") or (cfg.qk_norm and cfg.qkv_bias != cfg.o_bias):
        raise ModelLoadError("no Hugging Face architecture has this combination of attention biases")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        r = cfg.rope_scaling
        rope.update(rope_type=r.rope_type, factor=r.factor, low_freq_factor=r.low_freq_factor,
                    high_freq_factor=r.high_freq_factor, original_max_position_embeddings=r.original_max_position)
    out = {"architectures": [arch], "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
            "tie_word_embeddings": cfg.tie_word_embeddings, "max_position_embeddings": cfg.max_position,
            "attention_bias": cfg.o_bias, "rope_parameters": rope,
            **({} if cfg.attn_logit_softcap is None else {"attn_logit_softcapping": cfg.attn_logit_softcap})}
    if cfg.sliding_window is not None:
        out.update(sliding_window=cfg.sliding_window, layer_types=[
            "sliding_attention" if i in cfg.sliding_layers else "full_attention" for i in range(cfg.num_layers)])
        if arch != "MistralForCausalLM":   # Qwen2/Qwen3 read the window only with use_sliding_window
            out.update(use_sliding_window=True, max_window_layers=cfg.sliding_layers[0])
    return out


def gemma3_to_hf(cfg: ModelConfig) -> dict:
    """A Gemma3ForCausalLM config.json (transformers 4's flat RoPE keys) of a
    Gemma 3 layout `cfg`; ModelLoadError for what Gemma 3 cannot say."""
    gemma = dict(norm_plus_one=True, sandwich_norms=True, qk_norm=True, rope_scaling=None, attn_sinks=False,
                 embed_scale=math.sqrt(cfg.hidden_size), qkv_bias=cfg.o_bias)
    if any(getattr(cfg, k) != v for k, v in gemma.items()):
        raise ModelLoadError("a Gemma 3 config has (1 + weight) norms, sandwich norms, q/k norms, sqrt(hidden) "
                             "embedding scale and no rope scaling or sinks")
    return {"architectures": [GEMMA3], "model_type": "gemma3_text", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
            "hidden_activation": cfg.hidden_act, "tie_word_embeddings": cfg.tie_word_embeddings,
            "max_position_embeddings": cfg.max_position, "attention_bias": cfg.o_bias,
            "rope_theta": cfg.rope_theta, "rope_local_base_freq": cfg.rope_local_theta or cfg.rope_theta,
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
            "sliding_window": cfg.sliding_window or 4096,
            "layer_types": ["sliding_attention" if i in cfg.sliding_layers else "full_attention"
                            for i in range(cfg.num_layers)],
            "attn_logit_softcapping": cfg.attn_logit_softcap, "final_logit_softcapping": cfg.final_logit_softcap}
