"""Stage 4, attention backend: the seam where SGLang's kernel or a user's own
implementation plugs in. A backend saves the rows' K/V at out_cache_loc, then
attends each query row to its request's prefix (through kv_indices) and to
the verify rows (k_extend) as the flat custom mask allows.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

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


@dataclass(frozen=True)
class ServerBatch:
    """One forward as a server's model runner hands it to its attention backend: the
    requests, their cached lengths and the rows' slots, and for target-verify the flat
    tree mask the worker built. The backend builds every index itself from these (and
    from req_to_token, which the scheduler writes), never from ddcheck's AttnMetadata."""

    mode: str                      # "extend" (a prefill) | "target-verify"
    input_ids: torch.Tensor        # [T] row tokens
    positions: torch.Tensor        # [T] row positions (prefix + depth)
    req_pool_indices: torch.Tensor  # [bs] row of req_to_token per request
    seq_lens: torch.Tensor         # [bs] cached (committed) length each request's rows read
    extend_lens: tuple[int, ...]   # rows per request (q_len each for target-verify)
    out_cache_loc: torch.Tensor    # [T] slot each row's K/V is written to
    custom_mask: torch.Tensor | None = None  # flat bool blocks (target-verify), as the worker hands it over
    topk: int = 1                  # the tree's per-depth candidates (EAGLE's verify input carries it)
    spec_info: Any = None          # a port's own verify input object, handed to SGLang as is when its type is
                                   # the backend's (else the backend builds its own from the fields above)

    def __post_init__(self) -> None:
        if self.mode not in ("extend", "target-verify"):
            raise ValueError(f"a server batch is an extend or a target-verify forward, got {self.mode!r}")
        bs, rows = self.req_pool_indices.numel(), sum(self.extend_lens)
        if self.seq_lens.numel() != bs or len(self.extend_lens) != bs:
            raise ValueError(f"{bs} requests but {self.seq_lens.numel()} seq_lens and {len(self.extend_lens)} extends")
        if not (self.input_ids.numel() == self.positions.numel() == self.out_cache_loc.numel() == rows):
            raise ValueError(f"{rows} rows but {self.input_ids.numel()} ids, {self.positions.numel()} positions, "
                             f"{self.out_cache_loc.numel()} slots")
        if self.mode == "target-verify" and len(set(self.extend_lens)) > 1:
            raise ValueError(f"a target-verify batch has one width q_len, got {sorted(set(self.extend_lens))}")

    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.numel()


@dataclass(frozen=True)
class ServingPool:
    """What a serving backend binds to once per engine: the engine's KV storage (SGLang's
    pool writes and reads these very tensors, so the engine's commit and audits see what
    SGLang wrote), the scheduler's req_to_token, and the sizes SGLang's buffers need."""

    k_buffer: list[torch.Tensor]   # per layer [slots, kv_heads, head_dim]
    v_buffer: list[torch.Tensor]   # per layer [slots, kv_heads, head_dim]
    req_to_token: torch.Tensor     # [max_reqs, max_context] the engine's table (copied into SGLang's per forward)
    num_heads: int
    layers: tuple[LayerAttention, ...]  # each layer's sinks and soft cap
    q_len: int                     # verify width (SGLang's speculative_num_draft_tokens)
    max_bs: int                    # the largest batch SGLang's buffers (and graph buckets) must hold

    def __post_init__(self) -> None:
        if len(self.k_buffer) != len(self.v_buffer) or len(self.layers) != len(self.k_buffer):
            raise ValueError(f"{len(self.k_buffer)} K, {len(self.v_buffer)} V buffers for {len(self.layers)} layers")
        if self.q_len < 1 or self.max_bs < 1:
            raise ValueError(f"q_len and max_bs must be >= 1, got {self.q_len}, {self.max_bs}")

    @property
    def max_context(self) -> int:
        return self.req_to_token.shape[1]


class ServingSession(Protocol):
    """One engine's binding of a serving backend: each forward runs inside `served(batch)`, which
    builds the backend's metadata from the batch and yields it (as AttnMetadata)."""

    def served(self, batch: ServerBatch) -> AbstractContextManager: ...


@runtime_checkable
class ServingBackend(Protocol):
    """A backend that takes whole forwards as a server hands them over (SGLang's own
    attention backend): bound to each engine's pool (`bind` -> that engine's session)."""

    def bind(self, pool: ServingPool) -> ServingSession: ...


def serving_of(backend) -> ServingBackend | None:
    """The backend if it serves whole batches, else None (ddcheck's metadata reaches it per layer)."""
    return backend if isinstance(backend, ServingBackend) else None
