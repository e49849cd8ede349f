"""Seeded random model presets and the local Hugging Face checkpoint loader."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ddschema import ModelConfig, weight_names

PRESETS: dict[str, ModelConfig] = {
    # fast enough for CI on 2 cores, even under the Triton interpreter
    "tiny": ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16),
    "small": ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4,
                         num_heads=8, num_kv_heads=2, head_dim=32),
    "tiny-qwen3": ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True),
    "tiny-qwen2": ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True),
}

SUPPORTED_ARCHS = {"LlamaForCausalLM": {}, "Qwen2ForCausalLM": {"qkv_bias": True},
                   "Qwen3ForCausalLM": {"qk_norm": True}}


class ModelLoadError(ValueError):
    """A preset or checkpoint that cannot be loaded (a usage error)."""


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded float32 weights. Scales keep logits spread (a few units) so
    greedy choices are not near-ties on every step."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name in weight_names(cfg):
        if name.endswith("norm.weight") or "layernorm" in name:
            t = 1.0 + 0.1 * torch.randn(weight_shape(cfg, name), generator=gen)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(weight_shape(cfg, name), generator=gen)
        else:
            shape = _shape(cfg, name)
            t = torch.randn(shape, generator=gen) * (1.0 / shape[1] ** 0.5)
            if name == "model.embed_tokens.weight":
                t = torch.randn(shape, generator=gen)
            if name == "lm_head.weight":
                t = t * 4.0
        out[name] = t.float()
    return out


def weight_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """The shape a checkpoint of `cfg` holds under `name` (Hugging Face layout)."""
    if name.endswith("norm.weight") or "layernorm" in name:
        return (cfg.head_dim,) if "_norm" in name and "self_attn" in name else (cfg.hidden_size,)
    if name.endswith(".bias"):
        return (cfg.num_heads * cfg.head_dim if ".q_proj" in name else cfg.num_kv_heads * cfg.head_dim,)
    return _shape(cfg, name)


def _shape(cfg: ModelConfig, name: str) -> tuple[int, int]:
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    table = {"embed_tokens": (cfg.vocab_size, h), "lm_head": (cfg.vocab_size, h), "q_proj": (q, h),
             "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
             "up_proj": (i, h), "down_proj": (h, i)}
    for key, shape in table.items():
        if key in name:
            return shape
    raise KeyError(name)


def config_from_hf(hf: dict) -> ModelConfig:
    """Raises ModelLoadError for an unsupported architecture or impossible
    values, KeyError for a missing field."""
    if not isinstance(hf, dict):
        raise ModelLoadError(f"config.json holds a {type(hf).__name__}, not an object")
    arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    heads = hf["num_attention_heads"]
    rope = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    flags = dict(SUPPORTED_ARCHS[arch])
    if arch == "LlamaForCausalLM" and hf.get("attention_bias"):
        flags["qkv_bias"] = True
    fields = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, rope_theta=float(rope),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position=hf.get("max_position_embeddings", 4096), **flags)
    try:
        return ModelConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"config.json describes no valid model: {e}") from None


def load_checkpoint(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """config.json + *.safetensors from a local directory."""
    if not path.is_dir():
        raise ModelLoadError(f"--model {path}: not a directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"--model {path}: no config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"--model {path}: no *.safetensors files")
    try:
        cfg = config_from_hf(json.loads(cfg_file.read_text()))
    except KeyError as e:
        raise ModelLoadError(f"--model {path}: config.json lacks {e}") from None
    except ModelLoadError as e:
        raise ModelLoadError(f"--model {path}: {e}") from None
    except ValueError as e:  # not JSON, not UTF-8
        raise ModelLoadError(f"--model {path}: bad config.json ({e})") from None
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"--model {path}: cannot read {f.name} ({e})") from None
    missing = [n for n in weight_names(cfg) if n not in weights]
    if missing:
        raise ModelLoadError(f"--model {path}: checkpoint lacks {missing[0]} (and {len(missing) - 1} more)")
    wrong = [n for n in weight_names(cfg) if tuple(weights[n].shape) != weight_shape(cfg, n)]
    if wrong:
        n = wrong[0]
        raise ModelLoadError(f"--model {path}: {n} has shape {list(weights[n].shape)}, config.json implies "
                             f"{list(weight_shape(cfg, n))} (and {len(wrong) - 1} more mismatches)")
    return cfg, {n: weights[n].float() for n in weight_names(cfg)}


def load_model(model: str, seed: int) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A preset name or a checkpoint directory."""
    if model in PRESETS:
        return PRESETS[model], random_weights(PRESETS[model], seed)
    if "/" in model or Path(model).exists():
        return load_checkpoint(Path(model))
    raise ModelLoadError(f"unknown model preset {model!r}; presets: {', '.join(PRESETS)} (or a checkpoint directory)")
