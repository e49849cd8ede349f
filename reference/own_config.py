"""The oracle's own value for every field of a model config that a family's
config.json leaves unset: a plain Llama decoder (SiLU, no biases, no soft
caps, no sliding window, full RoPE at base 10000). Each reader of the oracle
builds its ModelConfig through `own_config`, which passes every field
explicitly, so no default of the shared schema (ddschema.config, a record
format to the oracle) decides the oracle's math: a wrong default there
reaches the engine's side alone and shows as a divergence."""
from __future__ import annotations

from dataclasses import fields

from ddschema.config import ModelConfig

PLAIN_DECODER = dict(
    rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=False, qk_norm=False, tie_word_embeddings=False,
    max_position=4096, o_bias=False, rope_scaling=None, attn_logit_softcap=None, attn_sinks=False,
    sliding_window=None, sliding_layers=(), hidden_act="silu", norm_plus_one=False, sandwich_norms=False,
    embed_scale=1.0, query_pre_attn_scalar=None, rope_local_theta=None, final_logit_softcap=None, mla=None,
    moe=None)
FIELDS = frozenset(f.name for f in fields(ModelConfig))   # the record format's fields


def own_config(**given) -> ModelConfig:
    """A ModelConfig with every field given here or in PLAIN_DECODER (ValueError for a field the record
    format lacks, or one it has and the oracle has no value of its own for)."""
    values = {**PLAIN_DECODER, **given}
    if set(values) != FIELDS:
        raise ValueError(f"the oracle's config fields {sorted(set(values) ^ FIELDS)} do not match the record "
                         "format's: each field needs the oracle's own value")
    return ModelConfig(**values)
