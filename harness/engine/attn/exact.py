"""Attention computed in float64 from the same q, k, v and the keys and mask the metadata names, with the
layer's own scale, cap and sinks: the independent stand-in that proves or clears the attention stage
(harness/check/localize/replace.py and stage_swap.py), and that a rerun of a killed run uses from the start
(harness/cli/watchdog.py sets REPLACE_STAGE_ENV, harness/check/prepare.py reads it). Here, below the check,
so that prepare.py reads it without importing the localizer (which imports prepare.py).

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import replace

import torch

from harness.engine.attn.base import PLAIN, LayerAttention


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
    # SGLang's reading (nonzero = visible) written here, not mask.kernel_visible: the stand-in shares no code
    # with the stages it replaces
    return (block != 0).reshape(n, prefix + n)


def exact_attention(q, keys, vals, visible, layer_attn: LayerAttention) -> torch.Tensor:
    """softmax(scale q k^T) v in float64 with GQA; q [n, heads, d], keys/vals [m, kv_heads, d], visible [n, m]."""
    group = q.shape[1] // keys.shape[1]
    keys, vals = keys.repeat_interleave(group, dim=1), vals.repeat_interleave(group, dim=1)
    # the scale computed here, not by LayerAttention.sm_scale: the stand-in shares no arithmetic with the backends
    scale = layer_attn.scaling if layer_attn.scaling is not None else q.shape[-1] ** -0.5
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale   # [heads, n, m]
    if layer_attn.logit_cap > 0:
        scores = layer_attn.logit_cap * torch.tanh(scores / layer_attn.logit_cap)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    if layer_attn.sinks is not None:   # a sink logit joins the denominator only
        sink = layer_attn.sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)   # [heads, n, 1]
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return torch.einsum("hqk,khd->qhd", probs, vals)


class ArmedAttention(ExactAttention):
    """The backend as it is until armed, then its attention in float64."""

    def __init__(self, inner, armed: bool = False) -> None:
        super().__init__(inner)
        self.armed = armed

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return super().forward(*args, **kwargs) if self.armed else self.inner.forward(*args, **kwargs)


# a rerun, in a fresh process, of a run a kernel killed: its attention replaced by the float64 one from the
# start (set by harness/cli/watchdog.py, read by harness/check/prepare.py); a killed process reruns nothing itself
REPLACE_STAGE_ENV = "DDCHECK_REPLACE_STAGE"


def with_replaced_attention(pipeline):
    """The pipeline with its attention computed in float64 from the start (the crash rung, in a new process)."""
    inner = pipeline.attention
    return replace(pipeline, attention=lambda b: ArmedAttention(inner(b) if inner is not None else b, armed=True))
