"""A stage proven guilty by replacing it, not by matching its symptoms
(issue 21 point 3). A run-level drift (every node a little worse than the
oracle's own low-precision twin, harness/verdict/noise_floor.py) says the
model's arithmetic differs but not where: the run is repeated with the
backend's attention replaced by an independent one (a float64 softmax over
the same q, k, v and the keys and mask the metadata names, with the
layer's own scale, cap and sinks). When the drift then goes away, the
attention backend's arithmetic was the cause; when it stays, the rest of
the forward (RoPE, the norms, the MLP, the loader) was.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from harness.engine.attn.base import PLAIN, LayerAttention, serving_of
from harness.engine.ddtree.mask import kernel_visible


class ExactAttention:
    """The wrapped backend's metadata reading, its attention computed in float64 (all else delegated)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def forward(self, q, k, v, layer, k_buffer, v_buffer, meta, layer_attn: LayerAttention = PLAIN) -> torch.Tensor:
        out = torch.empty_like(q)   # [rows, heads, d]
        qo, kvp = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
        for b in range(len(qo) - 1):
            rows = slice(qo[b], qo[b + 1])
            n, prefix = qo[b + 1] - qo[b], kvp[b + 1] - kvp[b]
            slots = meta.kv_indices[kvp[b]:kvp[b + 1]]
            keys = torch.cat([k_buffer[slots], k[rows]]).double()   # [prefix+n, kv_heads, d]
            vals = torch.cat([v_buffer[slots], v[rows]]).double()
            out[rows] = exact_attention(q[rows].double(), keys, vals, _visible(meta, b, prefix, n),
                                        layer_attn).to(q.dtype)
        return out


def _visible(meta, b: int, prefix: int, n: int) -> torch.Tensor:
    """visible  # [n, prefix+n]: the request's block of the flat mask at mask_indptr[b], row stride prefix + n;
    causal over the extend without a mask."""
    if meta.custom_mask is None:
        vis = torch.ones((n, prefix + n), dtype=torch.bool)
        vis[:, prefix:] = torch.ones((n, n), dtype=torch.bool).tril()
        return vis.to(meta.qo_indptr.device)
    start = int(meta.mask_indptr[b])
    block = meta.custom_mask.reshape(-1)[start:start + n * (prefix + n)]
    return kernel_visible(block).reshape(n, prefix + n)


def exact_attention(q, keys, vals, visible, layer_attn: LayerAttention) -> torch.Tensor:
    """softmax(scale q k^T) v in float64 with GQA; q [n, heads, d], keys/vals [m, kv_heads, d], visible [n, m]."""
    group = q.shape[1] // keys.shape[1]
    keys, vals = keys.repeat_interleave(group, dim=1), vals.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * layer_attn.sm_scale(q.shape[-1])   # [heads, n, m]
    if layer_attn.logit_cap > 0:
        scores = layer_attn.logit_cap * torch.tanh(scores / layer_attn.logit_cap)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    if layer_attn.sinks is not None:   # a sink logit joins the denominator only
        sink = layer_attn.sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)   # [heads, n, 1]
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return torch.einsum("hqk,khd->qhd", probs, vals)


@dataclass(frozen=True)
class Replaced:
    stage: str            # the stage whose output was replaced
    drift_before: float
    drift_after: float | None   # None: the rerun could not be judged
    limit: float

    @property
    def cause(self) -> bool:
        """The replacement made the run correct: the replaced stage was the cause."""
        return self.drift_after is not None and self.drift_after <= self.limit

    def sentence(self) -> str:
        after = "could not be judged" if self.drift_after is None else f"{self.drift_after:.2f}"
        verdict = ("so the attention backend's arithmetic is the cause" if self.cause else
                   "so the cause lies in the rest of the forward (RoPE, norms, MLP, loader), not the attention")
        return (f"with the backend's attention replaced by a float64 softmax of the same inputs the drift is "
                f"{after} (was {self.drift_before:.2f}, limit {self.limit:.2f}): {verdict}")


def replace_attention(p, drift_before: float, limit: float, check: Callable) -> Replaced | None:
    """Rerun p's setting with ExactAttention around its backend, judged by `check` (the differential check,
    without localizing); None where the backend builds its own metadata (SGLang's serving backend: the
    wrapper would not see the batch it served)."""
    from harness.check.prepare import derive
    from harness.check.records import RecordWriter
    if serving_of(p.engine.kernel) is not None:
        return None
    pipeline = p.engine.pipeline
    inner = pipeline.attention
    wrap = (lambda b: ExactAttention(inner(b))) if inner is not None else ExactAttention
    rerun = derive(p, pipeline=replace(pipeline, attention=wrap))
    summary = check(rerun, RecordWriter(None), localize=False)
    return Replaced("attention", drift_before, summary.noise_drift, limit)
