"""The oracle reads a Hugging Face checkpoint directory on its own: its own
config.json mapping and its own safetensors parser (the format is an 8-byte
little-endian header length, a JSON header naming each tensor's dtype, shape
and byte range, then the raw bytes). Nothing here comes from harness/ or the
safetensors package, so a loader bug on the engine's side cannot hide in
both readings at once.

Every config key that changes the math is either implemented (in
reference/model.py, reference/rope.py) or refused with CheckpointRefused:
never silently ignored.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from torch import Tensor

from ddschema.config import ModelConfig, RopeScaling
from reference.deepseek_config import DEEPSEEK_V3, read_deepseek_config
from reference.names import mla_moe_shapes, weight_names
from reference.gemma3 import GEMMA3, read_gemma3_config
from reference.own_config import own_config


class CheckpointRefused(ValueError):
    """A checkpoint the oracle cannot read faithfully (one line, a usage error)."""


# architecture -> (qkv_bias forced, qk_norm, honours attention_bias, default max_position_embeddings)
# (Hugging Face's defaults: Llama 2048, Qwen2 and Qwen3 32768)
ARCHITECTURES = {
    "LlamaForCausalLM": (False, False, True, 2048),
    "Qwen2ForCausalLM": (True, False, False, 32768),
    "Qwen3ForCausalLM": (False, True, True, 32768),
    "MistralForCausalLM": (False, False, False, 32768),
}

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                      "BF16": torch.bfloat16}


def read_header(f, path: Path) -> tuple[int, dict]:
    """(byte offset of the tensors' data, the JSON header without __metadata__) of an open .safetensors file."""
    size = path.stat().st_size
    head = f.read(8)
    if len(head) < 8:
        raise CheckpointRefused(f"{path.name}: too short for a safetensors file")
    (header_len,) = struct.unpack("<Q", head)
    if 8 + header_len > size:
        raise CheckpointRefused(f"{path.name}: header runs past the end of the file")
    header = json.loads(f.read(header_len).decode("utf-8"))
    return 8 + header_len, {name: entry for name, entry in header.items() if name != "__metadata__"}


def read_safetensors(path: Path, device: str = "cpu") -> dict[str, Tensor]:
    """Every tensor of one .safetensors file, as float64 on `device`. Reads one
    tensor's bytes at a time and moves it before widening it, so neither the
    file nor its float64 copy is ever held whole in host memory."""
    path = Path(path)
    with path.open("rb") as f:
        body, header = read_header(f, path)
        return {name: _read_tensor(f, body, name, entry, path.name, device) for name, entry in header.items()}


def _read_tensor(f, body: int, name: str, entry: dict, file_name: str, device: str = "cpu") -> Tensor:
    """One tensor at byte offsets `entry["data_offsets"]` after the header, little-endian."""
    if entry["dtype"] not in SAFETENSORS_DTYPES:
        raise CheckpointRefused(f"{file_name}: {name} has dtype {entry['dtype']}, "
                                f"the oracle reads {', '.join(SAFETENSORS_DTYPES)}")
    begin, end = entry["data_offsets"]
    dtype = SAFETENSORS_DTYPES[entry["dtype"]]
    f.seek(body + begin)
    raw = bytearray(end - begin)          # read straight into a writable buffer: one copy of the bytes
    if f.readinto(raw) != end - begin:
        raise CheckpointRefused(f"{file_name}: {name} runs past the end of the file")
    flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)  # [numel]
    return flat.reshape(entry["shape"]).to(device).to(torch.float64)


def rope_scaling_of(hf: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either spelling: transformers 5's
    `rope_parameters` or 4.x's top-level `rope_theta` plus `rope_scaling`."""
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise CheckpointRefused("partial_rotary_factor != 1 (partial RoPE) is not supported")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise CheckpointRefused(f"rope type {kind!r} is not supported (default and llama3 are)")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if key not in params:
            raise CheckpointRefused(f"llama3 rope scaling lacks {key}")
    try:
        return theta, RopeScaling("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                                  float(params["high_freq_factor"]),
                                  int(params["original_max_position_embeddings"]))
    except ValueError as e:
        raise CheckpointRefused(f"llama3 rope scaling: {e}") from None


def refuse_unsupported_math(hf: dict, arch: str) -> None:
    """Raise CheckpointRefused for a key that would change the forward pass
    and that this oracle does not implement."""
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointRefused(f"hidden_act {hf['hidden_act']!r} is not supported (silu is)")
    if hf.get("mlp_bias"):
        raise CheckpointRefused("mlp_bias is not supported")
    if hf.get("final_logit_softcapping") is not None:
        raise CheckpointRefused("final_logit_softcapping (soft-capping of the output logits) is not supported")
    types = hf.get("layer_types")
    if types is not None:
        if not isinstance(types, list):
            raise CheckpointRefused("layer_types must be a list")
        for kind in types:
            if kind not in ("full_attention", "sliding_attention"):
                raise CheckpointRefused(f"layer type {kind!r} is not supported (full_attention and "
                                        "sliding_attention are)")
    if arch == "LlamaForCausalLM" and (hf.get("sliding_window") is not None or "sliding_attention" in (types or [])):
        raise CheckpointRefused("a sliding window on LlamaForCausalLM is not supported (Hugging Face's Llama "
                                "has none; Mistral, Qwen2 and Qwen3 do)")


def sliding_window_of(hf: dict, arch: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(window, sliding layer indices) as transformers lays the layers out:
    `layer_types` when given, else every layer for Mistral, else layers
    max_window_layers.. for Qwen2/Qwen3 under use_sliding_window."""
    sliding: list[int] = []
    if hf.get("layer_types") is not None:
        if len(hf["layer_types"]) != num_layers:
            raise CheckpointRefused(f"layer_types has {len(hf['layer_types'])} entries for {num_layers} layers")
        sliding = [i for i in range(num_layers) if hf["layer_types"][i] == "sliding_attention"]
    elif arch == "MistralForCausalLM":
        if hf.get("sliding_window") is not None:
            sliding = list(range(num_layers))
    elif arch != "LlamaForCausalLM" and hf.get("use_sliding_window", False):
        start = hf.get("max_window_layers", 28)   # transformers' default for Qwen2 and Qwen3
        if type(start) is not int or start < 0:
            raise CheckpointRefused(f"max_window_layers {start!r} is not a layer count")
        sliding = list(range(start, num_layers))
    if len(sliding) == 0:
        return None, ()
    window = hf.get("sliding_window")
    if type(window) is not int or window <= 0:
        raise CheckpointRefused(f"sliding_window {window!r} is not a positive window length")
    return window, tuple(sliding)


def read_config(hf: dict) -> ModelConfig:
    """config.json (already parsed) -> ModelConfig, by the reader OWN_READERS
    names for its architecture. Raises CheckpointRefused."""
    if not isinstance(hf, dict):
        raise CheckpointRefused("config.json is not a JSON object")
    arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    if not isinstance(arch, str) or arch not in OWN_READERS:
        raise CheckpointRefused(f"architecture {arch!r} is not supported ({', '.join(OWN_READERS)} are)")
    return OWN_READERS[arch](hf, arch)


def read_llama_family_config(hf: dict, arch: str) -> ModelConfig:
    """A Llama / Qwen2 / Qwen3 / Mistral config.json (parsed) -> ModelConfig."""
    refuse_unsupported_math(hf, arch)
    qkv_bias, qk_norm, honours_bias, default_max = ARCHITECTURES[arch]
    attention_bias = bool(hf.get("attention_bias", False)) and honours_bias
    theta, scaling = rope_scaling_of(hf)
    cap = hf.get("attn_logit_softcapping")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
        raise CheckpointRefused(f"attn_logit_softcapping must be a positive number, got {cap!r}")
    try:
        heads = int(hf["num_attention_heads"])
        window, sliding = sliding_window_of(hf, arch, int(hf["num_hidden_layers"]))
        return own_config(
            vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]), num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads), rope_theta=theta,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qkv_bias=qkv_bias or attention_bias,
            qk_norm=qk_norm, tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position=int(hf.get("max_position_embeddings") or default_max),
            o_bias=attention_bias, rope_scaling=scaling,
            attn_logit_softcap=None if cap is None else float(cap), sliding_window=window, sliding_layers=sliding)
    except KeyError as e:
        raise CheckpointRefused(f"config.json lacks {e}") from None
    except (TypeError, ValueError) as e:
        raise CheckpointRefused(f"config.json describes no valid model: {e}") from None


# architecture (config.json's architectures[0]) -> the oracle's own config reader for it
OWN_READERS = {
    **{arch: read_llama_family_config for arch in ARCHITECTURES},
    GEMMA3: lambda hf, arch: read_gemma3_config(hf, CheckpointRefused),
    DEEPSEEK_V3: lambda hf, arch: read_deepseek_config(hf, CheckpointRefused),
}


def read_checkpoint_config(directory: Path) -> ModelConfig:
    """The directory's config.json as the oracle reads it (CheckpointRefused when absent or refused)."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise CheckpointRefused(f"{directory}: no config.json")
    try:
        return read_config(json.loads((directory / "config.json").read_text()))
    except ValueError as e:
        raise CheckpointRefused(f"{directory}: {e}") from None


def with_tensors(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], directory: Path,
                 keep_missing: bool = False) -> ModelConfig:
    """cfg completed by what only the tensors say (attention sinks are tensors
    in gpt-oss's checkpoints, never a config key: their presence sets them);
    CheckpointRefused when a tensor the forward pass uses is absent, or not of
    the shape the config implies. shapes: every tensor's shape by name. keep_missing: an absent
    tensor is left to the caller to state (reference/names.py names what the oracle needs)."""
    if any(n.endswith(".self_attn.sinks") for n in shapes):
        cfg = ModelConfig(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "attn_sinks": True})
    missing = [n for n in weight_names(cfg) if n not in shapes]
    if missing and not keep_missing:
        raise CheckpointRefused(f"{directory}: checkpoint lacks {missing[0]} (and {len(missing) - 1} more)")
    wrong = [(n, s) for n, s in mla_moe_shapes(cfg).items() if n in shapes and tuple(shapes[n]) != s]
    if wrong:
        raise CheckpointRefused(f"{directory}: {wrong[0][0]} has shape {list(shapes[wrong[0][0]])}, "
                                f"config.json implies {list(wrong[0][1])} (and {len(wrong) - 1} more)")
    return cfg


def load_checkpoint(directory: Path, device: str = "cpu",
                    keep_missing: bool = False) -> tuple[ModelConfig, dict[str, Tensor]]:
    """(config, float64 tensors on `device` under Hugging Face names) of a
    checkpoint directory: config.json plus every *.safetensors file in it.
    A tensor the config implies and the files lack is refused, unless
    keep_missing: then the tensors present are returned (the caller states
    what is missing; reference/names.py names what the oracle needs)."""
    directory = Path(directory)
    cfg = read_checkpoint_config(directory)
    weights: dict[str, Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        weights.update(read_safetensors(f, device))
    cfg = with_tensors(cfg, {n: tuple(t.shape) for n, t in weights.items()}, directory, keep_missing)
    return cfg, {n: weights[n] for n in weight_names(cfg) if n in weights}
