"""config.json <-> ModelConfig for DeepSeek-V3's layout (DeepseekV3ForCausalLM:
DeepSeek-V3, Kimi K2), on the engine's side: multi-head latent attention, a
mixture of experts with sigmoid routing and a correction bias, YaRN RoPE. A
key absent from config.json takes transformers' DeepseekV3Config default;
every key that changes the math and is not implemented is a one-line refusal
(DeepseekConfigError, which hf_config turns into ModelLoadError, exit 2).

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import math

from ddschema import MlaConfig, ModelConfig, MoeConfig, YarnScaling

ARCHITECTURE = "DeepseekV3ForCausalLM"
# transformers' DeepseekV3Config defaults, for keys config.json leaves out
DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 4096,
            "rope_theta": 10000.0, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
            "routed_scaling_factor": 1.0, "norm_topk_prob": True, "first_k_dense_replace": 0,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128}
YARN_KEYS = ("factor", "original_max_position_embeddings")
# keys whose value is fixed by what is implemented: key -> the values accepted
FIXED = {"hidden_act": ("silu",), "scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",),
         "moe_layer_freq": (1,), "attention_bias": (False,), "mlp_bias": (False,),
         "rope_interleave": (True,)}


class DeepseekConfigError(ValueError):
    """A DeepSeek-V3 config.json the engine does not implement."""


def _int(hf: dict, key: str, minimum: int = 1) -> int:
    v = hf.get(key, DEFAULTS.get(key))
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise DeepseekConfigError(f"config.json: {key} must be an integer >= {minimum}, got {v!r}")
    return v


# keys that change the math and are not implemented: refused by name, never ignored
REFUSED = ("quantization_config",)


def _refuse_unimplemented(hf: dict) -> None:
    for key in REFUSED:
        if hf.get(key) is not None:
            raise DeepseekConfigError(f"config.json sets {key}, which changes the math and is not supported")
    for key, accepted in FIXED.items():
        if key in hf and hf[key] not in accepted:
            raise DeepseekConfigError(f"config.json sets {key} {hf[key]!r} (only {accepted[0]!r}), which changes "
                                      "the math and is not supported")


def _yarn(hf: dict) -> YarnScaling | None:
    parts = [hf.get("rope_scaling") or {}, hf.get("rope_parameters") or {}]   # transformers 4's and 5's spellings
    if not all(isinstance(part, dict) for part in parts):
        raise DeepseekConfigError(f"config.json: rope_scaling and rope_parameters must be objects, got {parts!r}")
    rope = {**parts[0], **parts[1]}
    kind = rope.get("type") or rope.get("rope_type") or "default"
    if kind == "default":
        return None
    if kind != "yarn":
        raise DeepseekConfigError(f"config.json sets rope type {kind!r} (default and yarn only), which changes "
                                  "the math and is not supported")
    absent = [k for k in YARN_KEYS if k not in rope]
    if absent:
        raise DeepseekConfigError(f"yarn rope scaling lacks {', '.join(absent)}")
    try:
        return YarnScaling(float(rope["factor"]), int(rope["original_max_position_embeddings"]),
                           float(rope.get("beta_fast", 32.0)), float(rope.get("beta_slow", 1.0)),
                           float(rope.get("mscale", 1.0)), float(rope.get("mscale_all_dim", 0.0)))
    except (TypeError, ValueError) as e:
        raise DeepseekConfigError(f"config.json: {e}") from None


def deepseek_config(hf: dict) -> ModelConfig:
    """ModelConfig of a DeepSeek-V3-layout config.json; DeepseekConfigError (one line)
    for what is not implemented or impossible, KeyError for a missing size."""
    _refuse_unimplemented(hf)
    q_lora = hf.get("q_lora_rank", DEFAULTS["q_lora_rank"])
    mla = MlaConfig(kv_lora_rank=_int(hf, "kv_lora_rank"), qk_nope_head_dim=_int(hf, "qk_nope_head_dim"),
                    qk_rope_head_dim=_int(hf, "qk_rope_head_dim"), v_head_dim=_int(hf, "v_head_dim"),
                    q_lora_rank=None if q_lora is None else _int(hf, "q_lora_rank"))
    moe = None
    if hf.get("n_routed_experts"):
        moe = MoeConfig(n_routed_experts=_int(hf, "n_routed_experts"),
                        num_experts_per_tok=_int(hf, "num_experts_per_tok"),
                        moe_intermediate_size=_int(hf, "moe_intermediate_size"),
                        n_shared_experts=_int(hf, "n_shared_experts", 0), n_group=_int(hf, "n_group"),
                        topk_group=_int(hf, "topk_group"),
                        routed_scaling_factor=float(hf.get("routed_scaling_factor",
                                                           DEFAULTS["routed_scaling_factor"])),
                        norm_topk_prob=bool(hf.get("norm_topk_prob", DEFAULTS["norm_topk_prob"])),
                        first_k_dense_replace=_int(hf, "first_k_dense_replace", 0))
        if moe.n_routed_experts // moe.n_group < 2:
            raise DeepseekConfigError("config.json: a group scores its top two experts, so n_routed_experts / "
                                      "n_group must be >= 2")
    heads = hf["num_attention_heads"]
    theta = (hf.get("rope_parameters") or {}).get("rope_theta") or hf.get("rope_theta", DEFAULTS["rope_theta"])
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
        raise DeepseekConfigError(f"config.json: rope_theta must be a positive number, got {theta!r}")
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"], num_heads=heads, num_kv_heads=heads, head_dim=mla.qk_head_dim,
        rope_theta=float(theta), rms_norm_eps=float(hf.get("rms_norm_eps", DEFAULTS["rms_norm_eps"])),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", DEFAULTS["tie_word_embeddings"])),
        max_position=hf.get("max_position_embeddings") or DEFAULTS["max_position_embeddings"],
        rope_scaling=_yarn(hf), mla=mla, moe=moe)


def deepseek_to_hf(cfg: ModelConfig) -> dict:
    """The config.json of a DeepSeek-V3-layout `cfg` (what deepseek_config reads back as `cfg`)."""
    m, e, r = cfg.mla, cfg.moe, cfg.rope_scaling
    if m is None or (r is not None and not isinstance(r, YarnScaling)) or cfg.sliding_window is not None:
        raise DeepseekConfigError("a DeepseekV3ForCausalLM config has MLA, YaRN or no rope scaling, no window")
    out = {"architectures": [ARCHITECTURE], "model_type": "deepseek_v3", "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
           "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
           "num_key_value_heads": cfg.num_heads, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
           "tie_word_embeddings": cfg.tie_word_embeddings, "max_position_embeddings": cfg.max_position,
           "rope_theta": cfg.rope_theta, "attention_bias": False, "q_lora_rank": m.q_lora_rank,
           "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
           "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim,
           "rope_scaling": None if r is None else {
               "type": "yarn", "factor": r.factor, "original_max_position_embeddings": r.original_max_position,
               "beta_fast": r.beta_fast, "beta_slow": r.beta_slow, "mscale": r.mscale,
               "mscale_all_dim": r.mscale_all_dim}}
    if e is not None:
        out.update(n_routed_experts=e.n_routed_experts, num_experts_per_tok=e.num_experts_per_tok,
                   moe_intermediate_size=e.moe_intermediate_size, n_shared_experts=e.n_shared_experts,
                   n_group=e.n_group, topk_group=e.topk_group, routed_scaling_factor=e.routed_scaling_factor,
                   norm_topk_prob=e.norm_topk_prob, first_k_dense_replace=e.first_k_dense_replace,
                   scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1)
    return out
