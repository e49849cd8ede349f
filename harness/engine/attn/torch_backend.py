"""A plain-torch backend that reads exactly the metadata SGLang's Triton kernel
reads: prefix K/V through kv_indices, verify-row K/V from k_extend, and the
flat mask through mask_indptr with row stride prefix + q_len.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import torch

from harness.engine.attn.base import PLAIN, LayerAttention
from harness.engine.ddtree.verify_inputs import AttnMetadata
from harness.engine.ddtree.mask import kernel_visible


class TorchBackend:
    name = "torch"
    mask_regions = frozenset({"prefix", "draft"})
    graph_capturable = False  # reads indptrs on the host
    reads_max_kv_len = True   # its prefix loop stops at meta.max_kv_len
    probability_dtype = None  # softmax and P @ V in float32 (_attend)
    runs_mla = True           # K and V of different widths (MLA's absorbed latent: harness/engine/model/mla.py)

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def forward(self, q, k, v, layer, k_buffer, v_buffer, meta: AttnMetadata,
                layer_attn: LayerAttention = PLAIN) -> torch.Tensor:
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])   # [T, heads, v width]
        qo, kvp = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
        for b in range(meta.batch_size):
            rows = slice(qo[b], qo[b + 1])
            prefix_slots = meta.kv_indices[kvp[b]:kvp[b + 1]]
            keys = torch.cat([k_buffer[prefix_slots], k[rows]])    # [prefix+n, kv_heads, d]
            vals = torch.cat([v_buffer[prefix_slots], v[rows]])
            allowed = _request_mask(meta, b, kvp[b + 1] - kvp[b], qo[b + 1] - qo[b])
            if meta.max_kv_len is not None and kvp[b + 1] - kvp[b] > meta.max_kv_len:
                allowed = allowed.clone()
                allowed[:, meta.max_kv_len:kvp[b + 1] - kvp[b]] = False   # past the loop's bound: never visited
            out[rows] = _attend(q[rows], keys, vals, allowed, layer_attn)
        return out


def _request_mask(meta: AttnMetadata, b: int, prefix: int, n: int) -> torch.Tensor:
    """allowed  # [n, prefix+n] as the kernel indexes it."""
    if meta.custom_mask is None:
        allowed = torch.ones((n, prefix + n), dtype=torch.bool, device=meta.qo_indptr.device)
        allowed[:, prefix:] = torch.ones((n, n), dtype=torch.bool).tril()
        return allowed
    start = int(meta.mask_indptr[b])
    stride = prefix + n  # n = q_len, from qo_indptr
    # pointer arithmetic, as the kernel does: a mask declared shorter than
    # mask_indptr says is read past its end (into the rest of its storage)
    flat = meta.custom_mask
    return kernel_visible(torch.as_strided(flat, (n, stride), (stride, 1), flat.storage_offset() + start))


def _attend(q, keys, vals, allowed, layer_attn: LayerAttention = PLAIN) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v with GQA; a fully masked row divides 0 by 0
    (NaN), as kernels without a guard do. A soft cap bends the scaled scores
    before the mask; a head's sink logit joins the denominator only."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1).float()
    vals = vals.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * layer_attn.sm_scale(q.shape[-1])   # [heads, n, keys]
    if layer_attn.logit_cap > 0:
        scores = layer_attn.logit_cap * torch.tanh(scores / layer_attn.logit_cap)
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    m = scores.amax(-1, keepdim=True).nan_to_num(neginf=0.0)                      # [heads, n, 1]
    sink = None if layer_attn.sinks is None else layer_attn.sinks.float()[:, None, None]   # [heads, 1, 1]
    if sink is not None:
        m = torch.maximum(m, sink)
    p = torch.exp(scores - m)
    denom = p.sum(-1, keepdim=True) + (0.0 if sink is None else torch.exp(sink - m))
    p = p / denom
    return torch.einsum("hqk,khd->qhd", p, vals).to(q.dtype)

