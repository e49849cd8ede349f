"""The KV pool's layout per model family: per-head K and V (grouped-query
attention), or MLA's one latent per token (SGLang's MLATokenToKVPool): K is
[kv_lora_rank latent | qk_rope_head_dim RoPE key] as one KV "head", V the
first kv_lora_rank columns of the same storage (a view, never a copy).

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import torch

from ddschema import ModelConfig


def kv_buffers(cfg: ModelConfig, num_slots: int, dtype: torch.dtype,
               device: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer k_buffer  # [slots, kv_heads, head_dim] and v_buffer, or for MLA
    k_buffer  # [slots, 1, rank+rope] and v_buffer  # [slots, 1, rank], a view of k_buffer."""
    if cfg.mla is None:
        shape = (num_slots, cfg.num_kv_heads, cfg.head_dim)
        return ([torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)],
                [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)])
    m = cfg.mla
    k = [torch.zeros((num_slots, 1, m.kv_lora_rank + m.qk_rope_head_dim), dtype=dtype, device=device)
         for _ in range(cfg.num_layers)]
    return k, [layer[..., :m.kv_lora_rank] for layer in k]


def is_latent(cfg: ModelConfig) -> bool:
    return cfg.mla is not None
