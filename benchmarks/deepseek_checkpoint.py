"""Write a random DeepSeek-V3-layout checkpoint (DeepseekV3ForCausalLM: config.json
plus safetensors shards), generated on the device; nothing is downloaded.

Shapes: the tiny presets (tiny-deepseek-v3, tiny-kimi-k2: a few layers and
experts, the first layer dense) and full-width layers of the real models with
fewer layers, experts and vocabulary (deepseek-v3-cut, kimi-k2-cut: every
attention and expert width as released, float64 of them fits one 80 GB GPU).

    python3 benchmarks/deepseek_checkpoint.py --shape deepseek-v3-cut --out /tmp/ds-cut --device cuda
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

_YARN_DS = dict(type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                mscale=1.0, mscale_all_dim=1.0)
_YARN_KIMI = dict(type="yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0,
                  mscale=1.0, mscale_all_dim=1.0)
_MOE = dict(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1, norm_topk_prob=True,
            hidden_act="silu", attention_bias=False, tie_word_embeddings=False, rms_norm_eps=1e-6)

# config.json fields (public layouts; the cut ones keep every width, fewer layers / experts / tokens)
SHAPES = {
    "tiny-deepseek-v3": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                             qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                             n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
                             first_k_dense_replace=1, routed_scaling_factor=2.5, rope_theta=10000.0,
                             max_position_embeddings=163840, rope_scaling=_YARN_DS, **_MOE),
    "tiny-kimi-k2": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=12, num_experts_per_tok=4,
                         n_group=1, topk_group=1, n_shared_experts=1, moe_intermediate_size=32,
                         first_k_dense_replace=1, routed_scaling_factor=2.827, rope_theta=50000.0,
                         max_position_embeddings=131072, rope_scaling=_YARN_KIMI, **_MOE),
    "deepseek-v3-cut": dict(vocab_size=4096, hidden_size=7168, intermediate_size=18432, num_hidden_layers=2,
                            num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                            qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=32, num_experts_per_tok=8,
                            n_group=8, topk_group=4, n_shared_experts=1, moe_intermediate_size=2048,
                            first_k_dense_replace=1, routed_scaling_factor=2.5, rope_theta=10000.0,
                            max_position_embeddings=163840, rope_scaling=_YARN_DS, **_MOE),
    "kimi-k2-cut": dict(vocab_size=4096, hidden_size=7168, intermediate_size=18432, num_hidden_layers=2,
                        num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=48, num_experts_per_tok=8,
                        n_group=1, topk_group=1, n_shared_experts=1, moe_intermediate_size=2048,
                        first_k_dense_replace=1, routed_scaling_factor=2.827, rope_theta=50000.0,
                        max_position_embeddings=131072, rope_scaling=_YARN_KIMI, **_MOE),
}


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a DeepseekV3ForCausalLM checkpoint of config `c`, Hugging Face names and shapes."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    qk, rank, rope = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    out = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,),
           "lm_head.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    a + "kv_a_proj_with_mqa.weight": (rank + rope, h), a + "kv_a_layernorm.weight": (rank,),
                    a + "kv_b_proj.weight": (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), rank),
                    a + "o_proj.weight": (h, heads * c["v_head_dim"])})
        if c["q_lora_rank"] is None:
            out[a + "q_proj.weight"] = (heads * qk, h)
        else:
            out.update({a + "q_a_proj.weight": (c["q_lora_rank"], h), a + "q_a_layernorm.weight": (c["q_lora_rank"],),
                        a + "q_b_proj.weight": (heads * qk, c["q_lora_rank"])})
        experts = []
        if i < c["first_k_dense_replace"]:
            experts.append(("mlp.", c["intermediate_size"]))
        else:
            out.update({p + "mlp.gate.weight": (c["n_routed_experts"], h),
                        p + "mlp.gate.e_score_correction_bias": (c["n_routed_experts"],)})
            experts += [(f"mlp.experts.{e}.", c["moe_intermediate_size"]) for e in range(c["n_routed_experts"])]
            experts.append(("mlp.shared_experts.", c["moe_intermediate_size"] * c["n_shared_experts"]))
        for prefix, width in experts:
            out.update({p + prefix + "gate_proj.weight": (width, h), p + prefix + "up_proj.weight": (width, h),
                        p + prefix + "down_proj.weight": (h, width)})
    return out


def random_tensor(name: str, dims: tuple[int, ...], gen: torch.Generator, device: str, wide: bool) -> torch.Tensor:
    """Tiny shapes: norms 1 + 0.1 N, projections N / sqrt(fan-in), logits a few units wide, a
    correction bias of 0.1 N (so it moves choices). Wide shapes: N(0, 0.02), norms 1, bias 0.01 N."""
    noise = torch.randn(dims, generator=gen, device=device, dtype=torch.float32)
    if "norm" in name:
        return torch.ones_like(noise) if wide else 1.0 + 0.1 * noise
    if name.endswith("e_score_correction_bias"):
        return (0.01 if wide else 0.1) * noise
    if wide:
        return 0.02 * noise
    if name == "model.embed_tokens.weight":
        return noise
    return noise / dims[1] ** 0.5 * (4.0 if name == "lm_head.weight" else 1.0)


def write(shape: str, out: Path, device: str = "cpu", seed: int = 0, dtype: torch.dtype = torch.float32,
          shard_bytes: int = 2 << 30, **overrides) -> Path:
    """The checkpoint directory `out` of SHAPES[shape] (config keys replaced by `overrides`)."""
    from safetensors.torch import save_file
    c = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **SHAPES[shape], **overrides}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(c, indent=1))
    gen = torch.Generator(device=device).manual_seed(seed)
    wide = c["hidden_size"] >= 1024
    shard, size, where = {}, 0, {}
    for name, dims in tensor_shapes(c).items():
        t = random_tensor(name, dims, gen, device, wide)
        shard[name] = (t.float() if name.endswith("e_score_correction_bias") else t.to(dtype)).cpu()
        size += shard[name].numel() * shard[name].element_size()
        if size >= shard_bytes:
            where.update(_save(save_file, shard, out / f"model-{len(set(where.values())):05d}.safetensors"))
            shard, size = {}, 0
    if shard:
        where.update(_save(save_file, shard, out / f"model-{len(set(where.values())):05d}.safetensors"))
    if len(set(where.values())) == 1:   # one file: Hugging Face's unsharded name
        (out / next(iter(where.values()))).rename(out / "model.safetensors")
    else:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": where}))
    return out


def _save(save_file, shard: dict, path: Path) -> dict[str, str]:
    save_file(shard, str(path))
    return {name: path.name for name in shard}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="stored dtype (default: bfloat16 for the cut shapes, float32 for the tiny ones)")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype or ("bfloat16" if SHAPES[a.shape]["hidden_size"] >= 1024 else "float32"))
    print(write(a.shape, a.out, a.device, a.seed, dtype))


if __name__ == "__main__":
    main()
