"""The oracle's own reading of a DeepSeek-V3-layout config.json
(DeepseekV3ForCausalLM: DeepSeek-V3, Kimi K2), independent of the engine's.

Every key of config.json is in exactly one of three tables, or refused:
  * MATH_KEYS: read, and each value changes the forward pass as
    reference/deepseek_v3.py, reference/moe.py and reference/rope.py compute it;
  * FIXED: keys whose only implemented value is named (hidden_act silu,
    scoring_func sigmoid, topk_method noaux_tc, moe_layer_freq 1, no biases,
    rope_interleave true; head_dim = qk_rope_head_dim and qk_head_dim =
    qk_nope_head_dim + qk_rope_head_dim as transformers writes them); another value is refused;
  * INERT: bookkeeping that never changes one logit (token ids, dtype names,
    training-only knobs such as aux_loss_alpha, the multi-token-prediction
    layer count whose layer the main forward never runs).
A key in none of them is refused by name: a checkpoint whose config says
something this oracle does not know is not checked as if it said nothing.
A key left out takes transformers' DeepseekV3Config default (DEFAULTS); an
absent or null n_routed_experts is a dense model (every layer a SwiGLU MLP).
rope_scaling (4.x) or rope_parameters (transformers 5) of type "yarn" is
read whole; its keys are refused the same way.
"""
from __future__ import annotations

import math

from ddschema.config import MlaConfig, ModelConfig, MoeConfig, YarnScaling
from reference.own_config import own_config

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"

DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 4096,
            "rope_theta": 10000.0, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
            "routed_scaling_factor": 1.0, "norm_topk_prob": True, "first_k_dense_replace": 0,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 2048}
MATH_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "rope_theta", "rope_scaling",
             "rope_parameters", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
             "v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
             "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace",
             "moe_intermediate_size")
FIXED = {"hidden_act": "silu", "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
         "attention_bias": False, "mlp_bias": False, "rope_interleave": True, "pretraining_tp": 1}
INERT = ("architectures", "model_type", "auto_map", "transformers_version", "torch_dtype", "dtype",
         "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "attention_dropout",
         "aux_loss_alpha", "seq_aux", "ep_size", "num_nextn_predict_layers", "_name_or_path", "name_or_path",
         "output_router_logits", "router_aux_loss_coef", "tokenizer_class", "return_dict",
         # MLA expands one latent into every query head: no K/V head count enters the math (DeepSeek's and
         # SGLang's code never read it; transformers' config saves its default 128 whatever the heads)
         "num_key_value_heads")
YARN_KEYS = ("type", "rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim")


def _number(hf: dict, key: str, refuse, positive: bool = True) -> float:
    v = hf.get(key, DEFAULTS.get(key))
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise refuse(f"config.json: {key} must be a {'positive ' if positive else ''}number, got {v!r}")
    return float(v)


def _count(hf: dict, key: str, refuse, minimum: int = 1) -> int:
    if key not in hf and key not in DEFAULTS:
        raise refuse(f"config.json lacks {key!r}")
    v = hf.get(key, DEFAULTS.get(key))
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise refuse(f"config.json: {key} must be an integer >= {minimum}, got {v!r}")
    return v


def _flag(hf: dict, key: str, refuse) -> bool:
    v = hf.get(key, DEFAULTS.get(key))
    if not isinstance(v, bool):
        raise refuse(f"config.json: {key} must be true or false, got {v!r}")
    return v


def refuse_unknown_keys(hf: dict, refuse) -> None:
    """Every key read (MATH_KEYS), fixed at its implemented value (FIXED) or inert (INERT)."""
    unknown = sorted(k for k in hf if k not in MATH_KEYS and k not in FIXED and k not in INERT
                     and k not in ("head_dim", "qk_head_dim"))
    if unknown:
        raise refuse(f"config.json sets {', '.join(unknown)}, which the oracle does not implement for "
                     f"{DEEPSEEK_V3} (quantized or otherwise changed math is refused, not ignored)")
    for key, value in FIXED.items():
        if key in hf and hf[key] != value:
            raise refuse(f"config.json sets {key} {hf[key]!r}; the oracle implements {value!r} only")
    rope = hf.get("qk_rope_head_dim", DEFAULTS["qk_rope_head_dim"])
    nope = hf.get("qk_nope_head_dim", DEFAULTS["qk_nope_head_dim"])
    if hf.get("qk_head_dim") is not None and (not isinstance(rope, int) or not isinstance(nope, int)
                                              or hf["qk_head_dim"] != nope + rope):
        raise refuse(f"config.json: qk_head_dim {hf['qk_head_dim']!r} is not qk_nope_head_dim + qk_rope_head_dim")
    if hf.get("head_dim") not in (None, rope):
        raise refuse(f"config.json: head_dim {hf['head_dim']!r} is not qk_rope_head_dim {rope!r} "
                     "(transformers' meaning of head_dim for this architecture)")


def read_yarn(hf: dict, refuse) -> tuple[float, YarnScaling | None]:
    """(rope_theta, YaRN scaling or None) from rope_scaling or rope_parameters."""
    params = {}
    for key in ("rope_scaling", "rope_parameters"):
        part = hf.get(key)
        if part is not None and not isinstance(part, dict):
            raise refuse(f"config.json: {key} must be an object, got {part!r}")
        params.update(part or {})
    unknown = sorted(k for k in params if k not in YARN_KEYS)
    if unknown:
        raise refuse(f"config.json: rope scaling sets {', '.join(unknown)}, which the oracle does not implement")
    theta = _number({"rope_theta": params.get("rope_theta", hf.get("rope_theta", DEFAULTS["rope_theta"]))},
                    "rope_theta", refuse)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise refuse(f"config.json: rope type {kind!r} is not supported for {DEEPSEEK_V3} (default and yarn are)")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in params:
            raise refuse(f"config.json: yarn rope scaling lacks {key}")
    try:
        return theta, YarnScaling(
            factor=_number(params, "factor", refuse),
            original_max_position=_count(params, "original_max_position_embeddings", refuse),
            beta_fast=_number({"b": params.get("beta_fast", 32.0)}, "b", refuse),
            beta_slow=_number({"b": params.get("beta_slow", 1.0)}, "b", refuse),
            mscale=_number({"m": params.get("mscale", 1.0)}, "m", refuse, positive=False),
            mscale_all_dim=_number({"m": params.get("mscale_all_dim", 0.0)}, "m", refuse, positive=False))
    except ValueError as e:
        if isinstance(e, refuse):
            raise
        raise refuse(f"config.json: {e}") from None


def read_mla(hf: dict, refuse) -> MlaConfig:
    q_lora = hf.get("q_lora_rank", DEFAULTS["q_lora_rank"])
    return MlaConfig(kv_lora_rank=_count(hf, "kv_lora_rank", refuse),
                     qk_nope_head_dim=_count(hf, "qk_nope_head_dim", refuse),
                     qk_rope_head_dim=_count(hf, "qk_rope_head_dim", refuse),
                     v_head_dim=_count(hf, "v_head_dim", refuse),
                     q_lora_rank=None if q_lora is None else _count(hf, "q_lora_rank", refuse))


def read_moe(hf: dict, refuse) -> MoeConfig | None:
    if hf.get("n_routed_experts") is None:
        return None
    try:
        moe = MoeConfig(n_routed_experts=_count(hf, "n_routed_experts", refuse),
                        num_experts_per_tok=_count(hf, "num_experts_per_tok", refuse),
                        moe_intermediate_size=_count(hf, "moe_intermediate_size", refuse),
                        n_shared_experts=_count(hf, "n_shared_experts", refuse, 0),
                        n_group=_count(hf, "n_group", refuse), topk_group=_count(hf, "topk_group", refuse),
                        routed_scaling_factor=_number(hf, "routed_scaling_factor", refuse),
                        norm_topk_prob=_flag(hf, "norm_topk_prob", refuse),
                        first_k_dense_replace=_count(hf, "first_k_dense_replace", refuse, 0))
    except ValueError as e:
        if isinstance(e, refuse):
            raise
        raise refuse(f"config.json: {e}") from None
    if moe.n_routed_experts // moe.n_group < 2 and moe.n_group > 1:
        raise refuse("config.json: a group scores the sum of its top two experts, so n_routed_experts / n_group "
                     "must be >= 2 when n_group > 1")
    return moe


def read_deepseek_config(hf: dict, refuse) -> ModelConfig:
    """A DeepSeek-V3-layout config.json (parsed) -> ModelConfig; `refuse` is
    the exception class raised (one line) for what is unknown or invalid."""
    refuse_unknown_keys(hf, refuse)
    theta, yarn = read_yarn(hf, refuse)
    try:
        mla, moe = read_mla(hf, refuse), read_moe(hf, refuse)
        heads = _count(hf, "num_attention_heads", refuse)
        return own_config(
            vocab_size=_count(hf, "vocab_size", refuse), hidden_size=_count(hf, "hidden_size", refuse),
            intermediate_size=_count(hf, "intermediate_size", refuse),
            num_layers=_count(hf, "num_hidden_layers", refuse), num_heads=heads, num_kv_heads=heads,
            head_dim=mla.qk_head_dim, rope_theta=theta, rms_norm_eps=_number(hf, "rms_norm_eps", refuse),
            tie_word_embeddings=_flag(hf, "tie_word_embeddings", refuse),
            max_position=_count(hf, "max_position_embeddings", refuse), rope_scaling=yarn, mla=mla, moe=moe)
    except ValueError as e:
        if isinstance(e, refuse):
            raise
        raise refuse(f"config.json describes no valid model: {e}") from None
