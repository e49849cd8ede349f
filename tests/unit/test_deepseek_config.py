"""reference/deepseek_config.py: the oracle's own reading of a DeepSeek-V3-layout
config.json, every key read or refused, and its place in the OWN_READERS registry."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks.deepseek_checkpoint import write
from ddschema.config import MlaConfig, MoeConfig, YarnScaling
from reference.checkpoint import OWN_READERS, CheckpointRefused, load_checkpoint, read_config

# DeepSeek-V3's released config.json, its sizes cut (quantization_config left out: refused below)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "aux_loss_alpha": 0.001,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}


def test_reads_deepseek_v3():
    cfg = read_config(DEEPSEEK_V3)
    assert cfg.mla == MlaConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                q_lora_rank=1536)
    assert cfg.moe == MoeConfig(n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                                n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                                norm_topk_prob=True, first_k_dense_replace=3)
    assert cfg.rope_scaling == YarnScaling(factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0,
                                           mscale=1.0, mscale_all_dim=1.0)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (128, 128, 192, 61)
    assert (cfg.intermediate_size, cfg.max_position, cfg.rope_theta) == (18432, 163840, 10000.0)


def test_reads_transformers_5_spelling_and_null_q_lora():
    """rope_parameters (transformers 5) instead of rope_scaling, head_dim / qk_head_dim as it saves
    them, a null q_lora_rank (one q_proj), no routed experts (a dense model)."""
    hf = {k: v for k, v in DEEPSEEK_V3.items() if k not in ("rope_scaling", "rope_theta", "n_routed_experts")}
    hf.update(rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
                               "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0},
              head_dim=64, qk_head_dim=192, q_lora_rank=None, rope_interleave=True, pad_token_id=None)
    cfg = read_config(hf)
    assert cfg.rope_theta == 50000.0 and cfg.rope_scaling.factor == 32.0 and cfg.rope_scaling.beta_fast == 1.0
    assert cfg.rope_scaling.mscale_all_dim == 0.0   # absent: DeepSeek's default
    assert cfg.mla.q_lora_rank is None and cfg.moe is None


@pytest.mark.parametrize("change, words", [
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"some_new_knob": 1}, "some_new_knob"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_interleave": False}, "rope_interleave"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"head_dim": 128}, "head_dim"),
    ({"qk_head_dim": 128}, "qk_head_dim"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "linear"),
    ({"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 4096}}, "factor"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                       "attention_factor": 1.2}}, "attention_factor"),
    ({"kv_lora_rank": "512"}, "kv_lora_rank"),
    ({"qk_rope_head_dim": 63}, "even"),
    ({"n_group": 7}, "n_group"),
    ({"norm_topk_prob": 1}, "norm_topk_prob"),
    ({"routed_scaling_factor": -1.0}, "routed_scaling_factor"),
    ({"first_k_dense_replace": 62}, "first_k_dense_replace"),
])
def test_refuses_what_it_does_not_implement(change, words):
    with pytest.raises(CheckpointRefused, match=words):
        read_config({**DEEPSEEK_V3, **change})


def test_missing_size_is_named():
    hf = {k: v for k, v in DEEPSEEK_V3.items() if k != "hidden_size"}
    with pytest.raises(CheckpointRefused, match="hidden_size"):
        read_config(hf)


def test_registry_names_every_architecture():
    assert "DeepseekV3ForCausalLM" in OWN_READERS and "LlamaForCausalLM" in OWN_READERS
    with pytest.raises(CheckpointRefused, match="DeepseekV3ForCausalLM"):
        read_config({**DEEPSEEK_V3, "architectures": ["DeepseekV2ForCausalLM"]})


def test_transformers_saved_config_reads(tmp_path):
    """A config transformers itself saves for this architecture is read whole (no key refused)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                             original_max_position_embeddings=4096))
    config.architectures = ["DeepseekV3ForCausalLM"]   # as a model's save_pretrained writes it
    config.save_pretrained(tmp_path)
    cfg = read_config(json.loads((tmp_path / "config.json").read_text()))
    assert cfg.mla.kv_lora_rank == 32 and cfg.moe.n_routed_experts == 8 and cfg.rope_scaling.factor == 40.0


def test_checkpoint_shape_mismatch_refused(tmp_path):
    """A tensor whose shape the config does not imply is refused by name, not read wrong."""
    d = write("tiny-kimi-k2", tmp_path, dtype=torch.float64)
    hf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**hf, "v_head_dim": 8}))
    with pytest.raises(CheckpointRefused, match="kv_b_proj"):
        load_checkpoint(d)
