"""Stage 4, attention backend: the seam where SGLang's kernel or a user's own
implementation plugs in. A backend saves the rows' K/V at out_cache_loc, then
attends each query row to its request's prefix (through kv_indices) and to
the verify rows (k_extend) as the flat custom mask allows.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from harness.engine.ddtree.verify_inputs import AttnMetadata

@dataclass(frozen=True)
class LayerAttention:
    """What one layer adds to softmax(q k^T / sqrt(d)) v besides the mask (SGLang's
    `sinks`, `logit_cap` and `sm_scale` arguments of its extend kernels; RadixAttention's `scaling`)."""

    sinks: torch.Tensor | None = None  # [heads] float32 sink logit per query head (gpt-oss); None: none
    logit_cap: float = 0.0             # c > 0: each scaled score s becomes c * tanh(s / c); 0: none
    scaling: float | None = None       # the scores' scale (Gemma: query_pre_attn_scalar**-0.5); None: d**-0.5

    def __post_init__(self) -> None:
        if self.logit_cap < 0:
            raise ValueError(f"logit_cap must be >= 0, got {self.logit_cap}")
        if self.sinks is not None and self.sinks.dim() != 1:
            raise ValueError(f"sinks are one logit per query head, got shape {list(self.sinks.shape)}")
        if self.scaling is not None and not 0 < self.scaling < float("inf"):
            raise ValueError(f"scaling must be a positive number, got {self.scaling}")

    def sm_scale(self, head_dim: int) -> float:
        """The softmax scale of scores q . k: `scaling`, else 1 / sqrt(head_dim)."""
        return self.scaling if self.scaling is not None else 1.0 / head_dim ** 0.5

    @property
    def plain(self) -> bool:
        return self.sinks is None and self.logit_cap == 0.0


PLAIN = LayerAttention()


class BackendUnavailable(RuntimeError):
    """The backend cannot run here (missing package, too old): a usage error."""


class AttentionBackend(Protocol):
    name: str
    mask_regions: frozenset[str]  # which parts of the mask the backend reads
    graph_capturable: bool        # may run inside torch.cuda.CUDAGraph capture
    # the dtype the kernel rounds attention's unnormalized probabilities to before P @ V
    # (flash-style kernels store them in the value dtype there), None where they stay float32:
    # the oracle's rounded computation rounds at the same place (harness/verdict/noise_floor.py)
    probability_dtype: torch.dtype | None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                k_buffer: torch.Tensor, v_buffer: torch.Tensor, meta: AttnMetadata,
                layer_attn: LayerAttention = PLAIN) -> torch.Tensor:
        """q  # [T, heads, head_dim]; k, v  # [T, kv_heads, head_dim] of the query rows;
        k_buffer, v_buffer  # [slots, kv_heads, head_dim] this layer's pool; layer_attn: the
        layer's sinks and soft cap. Returns o  # [T, heads, head_dim]. K/V are already saved
        at out_cache_loc."""
