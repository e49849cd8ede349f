"""Write a random checkpoint shaped like a real model: config.json plus
safetensors shards of N(0, 0.02) weights (norms 1), generated on the device
(a GPU writes an 8B model's 16 GB in a minute; nothing is downloaded).

    python3 benchmarks/random_checkpoint.py --shape llama-3.1-8b --out /tmp/ckpt-8b --device cuda
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

# Hugging Face config.json fields of the public models' layouts (no weights)
SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, max_position_embeddings=131072,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                         rope_theta=500000.0, max_position_embeddings=131072,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "llama-3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                          rope_theta=500000.0, max_position_embeddings=131072,
                          rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0, original_max_position_embeddings=8192)),
    # for checking the scripts on a CPU
    "check": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=False,
                  rope_theta=500000.0, max_position_embeddings=4096),
}


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = (c["vocab_size"], h)
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i)})
    return out


def write(shape: str, out: Path, device: str, seed: int = 0, shard_bytes: int = 2 << 30,
          cut: dict | None = None) -> Path:
    """cut: config.json fields that override the shape's (num_hidden_layers, vocab_size: a model cut to fit)."""
    from safetensors.torch import save_file
    c = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
         "torch_dtype": "bfloat16", **SHAPES[shape], **(cut or {})}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(c, indent=1))
    gen = torch.Generator(device=device).manual_seed(seed)
    shard, size, n = {}, 0, 0
    for name, dims in tensor_shapes(c).items():
        if len(dims) == 1:
            t = torch.ones(dims, dtype=torch.bfloat16, device=device)
        else:
            t = (torch.randn(dims, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        shard[name] = t.cpu()
        size += t.numel() * 2
        if size >= shard_bytes:
            save_file(shard, str(out / f"model-{n:05d}.safetensors"))
            shard, size, n = {}, 0, n + 1
    if shard:
        save_file(shard, str(out / f"model-{n:05d}.safetensors"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(write(a.shape, a.out, a.device, a.seed), file=sys.stderr)


if __name__ == "__main__":
    main()
