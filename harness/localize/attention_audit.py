"""The attention backend on its own: random queries, keys and values through
the batch's very metadata (kv_indices swapped for scratch slots, as the mask
probe does) against a float64 dense softmax over the visibility SGLang's
rules read from that metadata (each request's block at mask_indptr[b], row
stride prefix + q_len; prefix columns always visible to a backend that skips
them). A difference is the backend's: the metadata is audited separately."""
from __future__ import annotations

from dataclasses import replace

import torch

from harness.localize.audits import ranges
from harness.localize.wrong import Wrong

TOLERANCE = 1e-2   # relative, max |out - ref| / max |ref|: float32 and TF32 dots sit far below it


def rule_visibility(meta, b: int, mask_regions: frozenset[str]) -> torch.Tensor | None:
    """allowed  # [rows, prefix+rows] bool, or None when the mask is shorter than mask_indptr says."""
    qo, kvp = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
    n, p = qo[b + 1] - qo[b], kvp[b + 1] - kvp[b]
    if meta.custom_mask is None:
        allowed = torch.ones((n, p + n), dtype=torch.bool)
        allowed[:, p:] = torch.ones((n, n), dtype=torch.bool).tril()
        return allowed
    start = int(meta.mask_indptr[b])
    flat = meta.custom_mask.cpu().bool()
    if flat.numel() < start + n * (p + n):
        return None
    allowed = flat[start:start + n * (p + n)].view(n, p + n).clone()
    if "prefix" not in mask_regions:
        allowed[:, :p] = True
    return allowed


def audit_attention(backend, meta, heads: int, kv_heads: int, head_dim: int, device: str,
                    step: int, probes=None, seed: int = 0) -> Wrong | None:
    """probes: the mask probe's per-request Visibility (to tell a misread mask from wrong arithmetic)."""
    qo, kvp = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
    t, n_idx = qo[-1], meta.kv_indices.numel()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((t, heads, head_dim), generator=g, dtype=torch.float64)
    k = torch.randn((t, kv_heads, head_dim), generator=g, dtype=torch.float64)
    v = torch.randn((t, kv_heads, head_dim), generator=g, dtype=torch.float64)
    kb = torch.randn((n_idx + 1, kv_heads, head_dim), generator=g, dtype=torch.float64)
    vb = torch.randn((n_idx + 1, kv_heads, head_dim), generator=g, dtype=torch.float64)
    probe_meta = replace(meta, kv_indices=torch.arange(1, n_idx + 1, dtype=torch.int64, device=device))
    f32 = dict(dtype=torch.float32, device=device)
    out = backend.forward(q.to(**f32), k.to(**f32), v.to(**f32), 0, kb.to(**f32), vb.to(**f32),
                          probe_meta).double().cpu()
    group = heads // kv_heads
    for b in range(meta.batch_size):
        allowed = rule_visibility(meta, b, backend.mask_regions)
        if allowed is None:
            continue
        rows = slice(qo[b], qo[b + 1])
        keys = torch.cat([kb[1 + kvp[b]:1 + kvp[b + 1]], k[rows]]).repeat_interleave(group, 1)
        vals = torch.cat([vb[1 + kvp[b]:1 + kvp[b + 1]], v[rows]]).repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[rows], keys) / head_dim ** 0.5
        live = allowed.any(-1)                       # rows with no visible key: 0/0, not judged
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", torch.softmax(scores[:, live], -1), vals)
        got = out[rows][live]
        err = float((got - ref).abs().nan_to_num(float("inf")).amax()) / max(float(ref.abs().max()), 1e-30)
        if err <= TOLERANCE:
            continue
        bad = ((got - ref).abs().nan_to_num(float("inf")).amax((-1, -2)) > TOLERANCE * float(ref.abs().max()))
        bad_rows = live.nonzero().flatten()[bad].tolist()
        misread = None
        if probes is not None and probes[b].effective.shape == allowed.shape:
            wrong = (probes[b].effective != allowed) & live[:, None]
            misread = wrong.nonzero().tolist() or None
        if misread and _explains(out[rows], q[rows], keys, vals, probes[b].effective, head_dim):
            r, c = misread[0]
            return Wrong(step, "attention", "visibility", b, r, int(allowed[r, c]), int(probes[b].effective[r, c]),
                         len(misread), f"the backend applies another visibility than the metadata it was handed "
                         f"(request index {b}: {len(misread)} (row, key) pairs, first row {r} key column {c}: "
                         f"metadata says {int(allowed[r, c])}, applied {int(probes[b].effective[r, c])})")
        return Wrong(step, "attention", "attention_output", b, bad_rows[0] if bad_rows else None, 0.0, err,
                     len(bad_rows), f"the backend's attention output on random inputs through this batch's "
                     f"metadata is off a float64 softmax over the same visible keys by {err:.2e} (relative) at "
                     f"rows {ranges(bad_rows)} of request index {b}, while it applies the visibility the "
                     "metadata gives: the arithmetic (scale, heads, softmax) is wrong")
    return None


def _explains(got, q, keys, vals, effective, head_dim: int) -> bool:
    """The backend's output is a right softmax over the visibility the probe measured: it misreads the mask,
    its arithmetic is right."""
    live = effective.any(-1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) / head_dim ** 0.5
    scores = scores.masked_fill(~effective[None], float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", torch.softmax(scores[:, live], -1), vals)
    err = float((got[live] - ref).abs().nan_to_num(float("inf")).amax()) / max(float(ref.abs().max()), 1e-30)
    return err <= TOLERANCE
