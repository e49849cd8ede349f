"""Stage 3c, window: a sliding window folded into the verify mask.

A sliding-window layer hides a key from a query whose position is `window`
or more past the key's (Hugging Face's convention: W keys, the query's own
included). In a verify batch a row's position is prefix + depth, and its
keys are the committed prefix (positions 0..prefix-1) and the verify rows
(their own positions). The window is folded into a second flat mask in
custom_mask's layout (the prefix columns included), which the sliding layers
read with the prefix columns switched on (skip_prefix_custom_mask off), the
way SGLang PR #39287 bounds EAGLE's window by each node's position rather
than its flattened row index; full-attention layers keep custom_mask.


Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import replace

import torch

from harness.engine.ddtree.verify_inputs import AttnMetadata, VerifyBatch
from harness.engine.ddtree.mask import kernel_visible


def window_keep(row_pos: torch.Tensor, prefix_len: int, window: int) -> torch.Tensor:
    """keep  # [n, prefix_len + n] bool: row i may see key j under the window.
    row_pos  # [n] the rows' positions; the prefix's keys sit at 0..prefix_len-1."""
    key_pos = torch.cat([torch.arange(prefix_len, device=row_pos.device), row_pos])  # [prefix + n]
    return (row_pos[:, None] - key_pos[None, :]) < window


def causal_blocks(meta: AttnMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """An extend's causal visibility as custom-mask blocks: each request's
    rows see its whole prefix and the rows up to their own.
    mask  # [sum_b n_b*(prefix_b+n_b)] flat bool; indptr  # [bs+1]"""
    qo, kvp = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
    blocks = []
    for b in range(meta.batch_size):
        n, p = qo[b + 1] - qo[b], kvp[b + 1] - kvp[b]
        block = torch.ones((n, p + n), dtype=torch.bool)
        block[:, p:] = torch.ones((n, n), dtype=torch.bool).tril()
        blocks.append(block.reshape(-1))
    sizes = torch.tensor([0] + [x.numel() for x in blocks], dtype=torch.int64)
    return torch.cat(blocks), torch.cumsum(sizes, 0)


def with_window(meta: AttnMetadata, positions: torch.Tensor, window: int,
                row_positions=None) -> AttnMetadata:
    """`meta` with window_mask: its custom mask (causal blocks for a prefill)
    AND the window by each row's position (`positions`  # [rows]).
    row_positions(b, prefix_len, rows_pos) -> [n] overrides the positions the
    window is measured from (a fault's hook)."""
    if meta.custom_mask is None:
        base, indptr = causal_blocks(meta)
    else:
        base, indptr = meta.custom_mask, meta.mask_indptr
    out = kernel_visible(base.to("cpu", copy=True))                       # [flat]
    qo, kvp, starts = meta.qo_indptr.tolist(), meta.kv_indptr.tolist(), indptr.tolist()
    pos = positions.cpu()
    for b in range(meta.batch_size):
        p = kvp[b + 1] - kvp[b]
        rows = pos[qo[b]:qo[b + 1]]                              # [n]
        if row_positions is not None:
            rows = row_positions(b, p, rows)
        keep = window_keep(rows, p, window).reshape(-1)         # [n*(p+n)]
        end = min(starts[b] + keep.numel(), out.numel())
        out[starts[b]:end] &= keep[:end - starts[b]]
    return replace(meta, window_mask=out.to(meta.qo_indptr.device), window_mask_indptr=indptr.to(meta.qo_indptr.device))


def fold_window(vb: VerifyBatch, window: int) -> VerifyBatch:
    """The verify batch with its window mask, by each row's position (prefix + depth)."""
    return replace(vb, attn=with_window(vb.attn, vb.positions, window))
