"""The attention backend on its own: random queries, keys and values through
the batch's very metadata (kv_indices swapped for scratch slots, as the mask
probe does) against a float64 dense softmax over the visibility SGLang's
rules read from that metadata (each request's block at mask_indptr[b], row
stride prefix + q_len; prefix columns always visible to a backend that skips
them). A difference is the backend's: the metadata is audited separately.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations


import torch

from harness.engine.attn.base import PLAIN, LayerAttention
from harness.check.localize.audits import ranges
from harness.check.localize.mask_probe import probe_slots
from harness.check.localize.wrong import Wrong

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
    flat = meta.custom_mask.cpu() != 0   # SGLang's reading, nonzero = visible, written here
    if flat.numel() < start + n * (p + n):
        return None
    allowed = flat[start:start + n * (p + n)].view(n, p + n).clone()
    if "prefix" not in mask_regions:
        allowed[:, :p] = True
    return allowed


def audit_attention(backend, meta, heads: int, kv_heads: int, head_dim: int, device: str,
                    step: int, probes=None, seed: int = 0, layer_attn: LayerAttention = PLAIN) -> Wrong | None:
    """probes: the mask probe's per-request Visibility (to tell a misread mask from wrong arithmetic);
    layer_attn: the sinks and soft cap of the model's first layer, handed to the backend and applied by
    the reference too (a backend that drops them on some rows is named by which rows)."""
    qo, kvp = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
    t, n_idx = qo[-1], meta.kv_indices.numel()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((t, heads, head_dim), generator=g, dtype=torch.float64)
    k = torch.randn((t, kv_heads, head_dim), generator=g, dtype=torch.float64)
    v = torch.randn((t, kv_heads, head_dim), generator=g, dtype=torch.float64)
    kb = torch.randn((n_idx + 1, kv_heads, head_dim), generator=g, dtype=torch.float64)
    vb = torch.randn((n_idx + 1, kv_heads, head_dim), generator=g, dtype=torch.float64)
    probe_meta = probe_slots(meta, device)     # the rows' K/V saved after the prefix, as the contract says
    f32 = dict(dtype=torch.float32, device=device)
    out = backend.forward(q.to(**f32), k.to(**f32), v.to(**f32), 0, torch.cat([kb, k]).to(**f32),
                          torch.cat([vb, v]).to(**f32), probe_meta, layer_attn).double().cpu()
    group = heads // kv_heads
    for b in range(meta.batch_size):
        allowed = rule_visibility(meta, b, backend.mask_regions)
        if allowed is None:
            continue
        rows = slice(qo[b], qo[b + 1])
        keys = torch.cat([kb[1 + kvp[b]:1 + kvp[b + 1]], k[rows]]).repeat_interleave(group, 1)
        vals = torch.cat([vb[1 + kvp[b]:1 + kvp[b + 1]], v[rows]]).repeat_interleave(group, 1)
        live = allowed.any(-1)                       # rows with no visible key: 0/0, not judged
        ref = _reference(q[rows], keys, vals, allowed, layer_attn)[live]
        got = out[rows][live]
        err = float((got - ref).abs().nan_to_num(float("inf")).amax()) / max(float(ref.abs().max()), 1e-30)
        if err <= TOLERANCE:
            continue
        bad = ((got - ref).abs().nan_to_num(float("inf")).amax((-1, -2)) > TOLERANCE * float(ref.abs().max()))
        bad_rows = live.nonzero().flatten()[bad].tolist()
        dropped = _dropped_extra(got, q[rows], keys, vals, allowed, layer_attn, live, step, b)
        if dropped is not None:
            return dropped
        misread = None
        if probes is not None and probes[b].effective.shape == allowed.shape:
            wrong = (probes[b].effective != allowed) & live[:, None]
            misread = wrong.nonzero().tolist() or None
        if misread and _explains(out[rows], q[rows], keys, vals, probes[b].effective, layer_attn):
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


def _reference(q, keys, vals, allowed, layer_attn: LayerAttention) -> torch.Tensor:
    """float64 softmax attention  # [rows, heads, d] over `allowed`, with the layer's soft cap and sinks."""
    scores = torch.einsum("qhd,khd->hqk", q, keys) * layer_attn.sm_scale(q.shape[-1])   # [heads, rows, keys]
    if layer_attn.logit_cap > 0:
        scores = layer_attn.logit_cap * torch.tanh(scores / layer_attn.logit_cap)
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    if layer_attn.sinks is not None:
        sink = layer_attn.sinks.double().cpu()[:, None, None].expand(-1, scores.shape[1], 1)   # [heads, rows, 1]
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return torch.einsum("hqk,khd->qhd", probs.nan_to_num(0.0), vals)


def _dropped_extra(got, q, keys, vals, allowed, layer_attn: LayerAttention, live, step: int, b: int) -> Wrong | None:
    """When every wrong row is a right softmax without the layer's sinks (or without its soft cap): which
    rows dropped it (the rest apply it). None when neither explains the output."""
    for quantity, without in (("sinks", LayerAttention(None, layer_attn.logit_cap, layer_attn.scaling)),
                              ("logit_cap", LayerAttention(layer_attn.sinks, 0.0, layer_attn.scaling))):
        if (layer_attn.sinks is None) if quantity == "sinks" else layer_attn.logit_cap == 0:
            continue
        full, bare = (_reference(q, keys, vals, allowed, a)[live] for a in (layer_attn, without))
        scale = max(float(full.abs().max()), 1e-30)
        fits = [(got - r).abs().nan_to_num(float("inf")).amax((-1, -2)) <= TOLERANCE * scale for r in (full, bare)]
        if not bool((fits[0] | fits[1]).all()) or bool(fits[0].all()):
            continue
        rows = live.nonzero().flatten()
        applied = rows[fits[0]].tolist()
        missed = rows[~fits[0]].tolist()
        first_only = applied == [0] and len(missed) == len(rows) - 1
        what = "sink logits" if quantity == "sinks" else "soft cap"
        return Wrong(step, "attention", quantity, b, missed[0], "applied on every row",
                     f"applied on rows {ranges(applied)} only" if applied else "dropped on every row", len(missed),
                     f"the backend drops the layer's {what} on rows {ranges(missed)} of request index {b} (their "
                     f"output is a right softmax without them) and applies them on "
                     f"{('rows ' + ranges(applied)) if len(applied) > 1 else ('row ' + ranges(applied)) if applied else 'no row'}",
                     hint="first-row-only" if first_only else "")
    return None


def _explains(got, q, keys, vals, effective, layer_attn: LayerAttention) -> bool:
    """The backend's output is a right softmax over the visibility the probe measured: it misreads the mask,
    its arithmetic is right."""
    live = effective.any(-1)
    if not bool(live.any()):   # the probe saw no row attend any key: there is no softmax over it to match
        return False
    ref = _reference(q, keys, vals, effective, layer_attn)[live]
    err = float((got[live] - ref).abs().nan_to_num(float("inf")).amax()) / max(float(ref.abs().max()), 1e-30)
    return err <= TOLERANCE
