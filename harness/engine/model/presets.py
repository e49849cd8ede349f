"""Seeded random model presets and the local Hugging Face checkpoint loader.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import json
import tempfile
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch

from ddschema import MlaConfig, ModelConfig, MoeConfig, YarnScaling, weight_names, weight_shapes
from harness.engine.model.hf_config import ModelLoadError, config_from_hf, config_to_hf  # noqa: F401  (re-exported)
from harness.engine.model.named import named_dir

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
    # sliding windows short enough that the prompts plus a verify round cross them (prompts of 5 to 23 tokens,
    # depth up to 7): Mistral-style on every layer, and Qwen2 with a Gemma-style alternating layer_types list
    "tiny-swa": ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=8, sliding_layers=(0, 1)),
    "tiny-qwen2-swa-alt": ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                                      num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True,
                                      sliding_window=10, sliding_layers=(0,)),
    # gpt-oss-style sink logits per head, and Gemma-2-style attention soft-capping (scores here are a few
    # units, so a cap of 2 bends most of them: a backend that drops the cap is far off)
    "tiny-sinks": ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16, attn_sinks=True),
    "tiny-softcap": ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=16, attn_logit_softcap=2.0),
    # Gemma 3's layout (Gemma3ForCausalLM): two sliding layers with their own RoPE base, then a full one; (1 + w)
    # and sandwich norms, GELU-tanh, sqrt(hidden) embedding scale, a query_pre_attn_scalar that is not head_dim
    # and a final soft cap near the logits' scale (each moves the logits: tests/unit/test_gemma3.py)
    "tiny-gemma3": ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3,
                               num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1_000_000.0, qk_norm=True,
                               tie_word_embeddings=True, sliding_window=8, sliding_layers=(0, 1),
                               hidden_act="gelu_pytorch_tanh", norm_plus_one=True, sandwich_norms=True,
                               embed_scale=8.0, query_pre_attn_scalar=24.0, rope_local_theta=10_000.0,
                               final_logit_softcap=10.0),
    # real models' layouts cut to 2 layers and a small vocabulary (Llama-3.2-1B: hidden 2048, 32 query and
    # 8 KV heads of 64; Llama-3.1-8B: hidden 4096, 32 and 8 heads of 128); minutes on CPU, not for CI loops
    "llama-1b-cut": ModelConfig(vocab_size=1024, hidden_size=2048, intermediate_size=8192, num_layers=2,
                                num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0),
    "llama-8b-cut": ModelConfig(vocab_size=1024, hidden_size=4096, intermediate_size=14336, num_layers=2,
                                num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0),
    # DeepSeek-V3's layout (DeepseekV3ForCausalLM): MLA with a LoRA query, a dense first layer then a MoE layer
    # of 8 routed experts in 4 groups (2 groups kept, 2 experts per token), one shared expert, YaRN RoPE whose
    # original context (64) the prompts plus a verify round cross
    "tiny-deepseek-v3": ModelConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=4,
        head_dim=24, max_position=256,
        rope_scaling=YarnScaling(factor=4.0, original_max_position=64, mscale=1.0, mscale_all_dim=1.0),
        mla=MlaConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=32),
        moe=MoeConfig(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                      n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1)),
    # Kimi K2's choices cut down: one expert group (no group limit), more experts per token, its RoPE base and
    # routed scaling factor, a query without LoRA (DeepSeek-V2-Lite's q_proj), two MoE layers after the dense one
    "tiny-kimi-k2": ModelConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=4,
        head_dim=24, rope_theta=50000.0, max_position=256,
        rope_scaling=YarnScaling(factor=32.0, original_max_position=64, mscale=1.0, mscale_all_dim=1.0),
        mla=MlaConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=None),
        moe=MoeConfig(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=16, n_shared_experts=1,
                      n_group=1, topk_group=1, routed_scaling_factor=2.827, first_k_dense_replace=1)),
    # DeepSeek-V3's full layer widths (hidden 7168, 128 heads, q LoRA 1536, latent 512 + RoPE 64, experts of 2048)
    # cut to one dense and one MoE layer of 16 experts (8 groups of 2, 4 kept, 8 per token): GPU only
    "deepseek-v3-cut": ModelConfig(
        vocab_size=1024, hidden_size=7168, intermediate_size=18432, num_layers=2, num_heads=128,
        num_kv_heads=128, head_dim=192, max_position=8192,
        rope_scaling=YarnScaling(factor=40.0, original_max_position=4096, mscale=1.0, mscale_all_dim=1.0),
        mla=MlaConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                      q_lora_rank=1536),
        moe=MoeConfig(n_routed_experts=16, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
                      n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=1)),
}


def with_window(cfg: ModelConfig, window: int | None) -> ModelConfig:
    """cfg with sliding window `window` (--sliding-window): on its own sliding
    layers if it has any, else on every layer; None leaves cfg as it is."""
    if window is None:
        return cfg
    return replace(cfg, sliding_window=window, sliding_layers=cfg.sliding_layers or tuple(range(cfg.num_layers)))


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded float32 weights. Scales keep logits spread (a few units) so
    greedy choices are not near-ties on every step."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name in weight_names(cfg):
        if name.endswith("norm.weight") or "layernorm" in name:   # (1 + w) norms: w near 0, the same scale
            t = (0.0 if cfg.norm_plus_one else 1.0) + 0.1 * torch.randn(weight_shape(cfg, name), generator=gen)
        elif name.endswith(".bias") or name.endswith("e_score_correction_bias"):
            t = 0.1 * torch.randn(weight_shape(cfg, name), generator=gen)
        elif name.endswith("self_attn.sinks"):   # sink logits near the scores' scale: they take a real share
            t = 1.0 + torch.randn(weight_shape(cfg, name), generator=gen)
        else:
            shape = weight_shape(cfg, name)
            t = torch.randn(shape, generator=gen) * (1.0 / shape[1] ** 0.5)
            if name == "model.embed_tokens.weight":
                t = torch.randn(shape, generator=gen)
            if name == "lm_head.weight":
                t = t * 4.0
        out[name] = t.float()
    return out


def weight_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """The shape a checkpoint of `cfg` holds under `name` (Hugging Face layout)."""
    mla_moe = weight_shapes(cfg) if cfg.mla is not None or cfg.moe is not None else {}
    if name in mla_moe:   # DeepSeek-V3's tensors: the schema's layout
        return mla_moe[name]
    if name.endswith("norm.weight") or "layernorm" in name:
        return (cfg.head_dim,) if "_norm" in name and "self_attn" in name else (cfg.hidden_size,)
    if name.endswith("self_attn.sinks"):
        return (cfg.num_heads,)
    if name.endswith(".bias"):
        if ".o_proj" in name:
            return (cfg.hidden_size,)
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


def read_config(path: Path) -> ModelConfig:
    """A checkpoint directory's config.json, parsed and validated; a ModelLoadError naming it otherwise."""
    try:
        return config_from_hf(json.loads((path / "config.json").read_text(encoding="utf-8")))
    except KeyError as e:
        raise ModelLoadError(f"--model {path}: config.json lacks {e}") from None
    except ModelLoadError as e:
        raise ModelLoadError(f"--model {path}: {e}") from None
    except (ValueError, TypeError, RecursionError, OSError) as e:  # not JSON, not UTF-8, a key of the wrong
        # type (architectures 5, rope_scaling "llama3"), nested too deep, unreadable
        raise ModelLoadError(f"--model {path}: bad config.json ({type(e).__name__})") from None


def _checkpoint_files(path: Path) -> list[Path]:
    if not path.is_dir():
        raise ModelLoadError(f"--model {path}: not a directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"--model {path}: no config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"--model {path}: no *.safetensors files")
    return files


def _check_layout(path: Path, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every weight the config implies is there, with the shape it implies."""
    missing = [n for n in weight_names(cfg) if n not in shapes]
    if missing:
        raise ModelLoadError(f"--model {path}: checkpoint lacks {missing[0]} (and {len(missing) - 1} more)")
    wrong = [n for n in weight_names(cfg) if shapes[n] != weight_shape(cfg, n)]
    if wrong:
        n = wrong[0]
        raise ModelLoadError(f"--model {path}: {n} has shape {list(shapes[n])}, config.json implies "
                             f"{list(weight_shape(cfg, n))} (and {len(wrong) - 1} more mismatches)")


def check_checkpoint(path: Path) -> ModelConfig:
    """What load_checkpoint refuses, found from config.json and the safetensors
    headers alone (no tensor is read): before any work of a sweep or gate."""
    from safetensors import SafetensorError, safe_open
    shapes: dict[str, tuple[int, ...]] = {}
    for f in _checkpoint_files(path):
        try:
            with safe_open(str(f), "pt") as st:
                shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"--model {path}: cannot read {f.name} ({e})") from None
    cfg = with_sinks_of(read_config(path), list(shapes))
    _check_layout(path, cfg, shapes)
    return cfg


def load_checkpoint(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """config.json + *.safetensors from a local directory."""
    files = _checkpoint_files(path)
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"--model {path}: cannot read {f.name} ({e})") from None
    cfg = with_sinks_of(read_config(path), list(weights))
    _check_layout(path, cfg, {n: tuple(w.shape) for n, w in weights.items()})
    # the file's dtype (an 8B bf16 checkpoint stays 16 GB on the host); float64 files as float32
    return cfg, {n: weights[n].float() if weights[n].dtype == torch.float64 else weights[n]
                 for n in weight_names(cfg)}


def with_sinks_of(cfg: ModelConfig, names: list[str]) -> ModelConfig:
    """gpt-oss keeps its attention sinks as tensors, not as a config key: a checkpoint holding
    `self_attn.sinks` tensors has them (every layer must then hold one: load_checkpoint checks)."""
    from dataclasses import replace
    return replace(cfg, attn_sinks=True) if any(n.endswith("self_attn.sinks") for n in names) else cfg


def model_config(model: str) -> ModelConfig:
    """The config of a preset or a checkpoint directory, weights unread (tensor names only)."""
    if model in PRESETS:
        return PRESETS[model]
    path = named_dir(model) or Path(model)
    from safetensors import safe_open
    return with_sinks_of(read_config(path), [n for f in sorted(path.glob("*.safetensors"))
                                             for n in safe_open(str(f), "pt").keys()])


def write_checkpoint(directory: Path, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> Path:
    """A Hugging Face checkpoint directory (config.json + model.safetensors) of cfg and weights."""
    from safetensors.torch import save_file
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=1))
    save_file({n: weights[n].contiguous() for n in weight_names(cfg)}, str(directory / "model.safetensors"))
    return directory


@contextmanager
def checkpoint_dir(model: str, seed: int, sliding_window: int | None = None) -> Iterator[Path]:
    """The checkpoint directory both sides load a run's model from: the
    directory itself, or a preset's seeded weights written to a temporary
    directory for the length of the block (so the oracle reads a preset from
    disk on its own, exactly like a real checkpoint). `sliding_window`
    (--sliding-window) is written into the config.json both sides read: a
    checkpoint directory is then a temporary one whose config.json carries it,
    its other files linked."""
    if model in PRESETS:
        with tempfile.TemporaryDirectory(prefix="ddcheck-preset-") as d:
            cfg = with_window(PRESETS[model], sliding_window)
            yield write_checkpoint(Path(d), cfg, random_weights(PRESETS[model], seed))
        return
    model = str(named_dir(model) or model)   # a registered trained model: its cache directory
    if ("/" in model or Path(model).exists()) and sliding_window is not None:
        with tempfile.TemporaryDirectory(prefix="ddcheck-window-") as d:
            yield _windowed_copy(Path(model), Path(d), sliding_window)
    elif "/" in model or Path(model).exists():
        yield Path(model)
    else:
        raise ModelLoadError(unknown_model(model))


def unknown_model(model: str) -> str:
    from harness.engine.model.named import REGISTRY
    return (f"unknown model {model!r}; presets: {', '.join(PRESETS)}; trained models: {', '.join(REGISTRY)} "
            "(`ddcheck models`); or a checkpoint directory")


def model_input(model: str) -> Path | None:
    """Where a run of `model` reads its checkpoint from, without reading or
    materializing it (a registered model's cache entry, a directory), None
    for a preset: an output path may never be it or lie in it."""
    from harness.engine.model.named import REGISTRY, cache_dir
    if model in PRESETS:
        return None
    return cache_dir(REGISTRY[model]) if model in REGISTRY else Path(model)


def model_dir(model: str) -> Path | None:
    """The checkpoint directory a run of `model` reads (a registered trained
    model's cache, materialized on first use), None for a preset."""
    if model in PRESETS:
        return None
    return named_dir(model) or Path(model)


def _windowed_copy(src: Path, dst: Path, window: int) -> Path:
    """dst: src's files linked, its config.json rewritten with sliding window `window`."""
    cfg = read_config(src)
    hf = json.loads((src / "config.json").read_text(encoding="utf-8"))
    if not isinstance(hf, dict):
        raise ModelLoadError(f"--model {src}: config.json is not an object")
    windowed = config_to_hf(with_window(cfg, window))   # raises for a combination no architecture has
    hf.update({k: windowed[k] for k in ("architectures", "sliding_window", "layer_types", "use_sliding_window",
                                        "max_window_layers") if k in windowed})
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f.resolve())
    (dst / "config.json").write_text(json.dumps(hf, indent=1))
    return dst


def load_model(model: str, seed: int, sliding_window: int | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A preset name or a checkpoint directory (with --sliding-window applied)."""
    if model in PRESETS:
        return with_window(PRESETS[model], sliding_window), random_weights(PRESETS[model], seed)
    model = str(named_dir(model) or model)
    if "/" in model or Path(model).exists():
        cfg, weights = load_checkpoint(Path(model))
        return with_window(cfg, sliding_window), weights
    raise ModelLoadError(unknown_model(model))
