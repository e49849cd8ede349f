"""The sliding-window mask of one verify round against its rule, on its own.

Rule: a sliding layer's row i sees key j iff custom_mask allows it and
position(i) - position(j) < W, where a prefix key's position is its index
and a verify row's is the batch's positions input (prefix + depth). The
found mask is what the sliding layers read: the batch's window mask, or
custom_mask itself when no window mask was built (the window left off).
Each wrong (row, key) pair is told by role: prefix keys near the window's
edge or verify rows, leaked (visible against the window) or blocked (hidden
inside it); the hint names a pattern the finding fits exactly: the window
measured from prefix + row index, or no window at all.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

import torch

from harness.engine.ddtree.window import with_window
from harness.check.localize.audits import ranges
from harness.check.localize.wrong import Wrong


def _blocks(flat: torch.Tensor, indptr: torch.Tensor, b: int, n: int, p: int) -> torch.Tensor:
    """Request b's [n, p+n] block of a flat mask (short buffers read as False)."""
    start = int(indptr[b])
    part = flat[start:start + n * (p + n)].bool()
    out = torch.zeros(n * (p + n), dtype=torch.bool)
    out[:part.numel()] = part
    return out.view(n, p + n)


def audit_window(engine, result) -> list[Wrong]:
    """One Wrong per request whose real rows' window visibility breaks the rule."""
    window = engine.cfg.sliding_window
    attn = result.batch.attn
    if window is None or attn.custom_mask is None:
        return []
    meta = attn.to("cpu")
    pos = result.batch.positions.cpu()
    want = with_window(meta, pos, window)
    by_index = with_window(meta, pos, window, row_positions=lambda b, p, rows: p + torch.arange(rows.numel()))
    found_flat = meta.window_mask if meta.window_mask is not None else meta.custom_mask
    found_ptr = meta.window_mask_indptr if meta.window_mask is not None else meta.mask_indptr
    n, out = result.batch.q_len, []
    for b, rs in enumerate(result.requests):
        p, real = len(rs.prefix), rs.tree.num_rows
        exp = _blocks(want.window_mask, want.window_mask_indptr, b, n, p)[:real]       # [real, p+n]
        got = _blocks(found_flat, found_ptr, b, n, p)[:real]                            # [real, p+n]
        if bool((exp == got).all()):
            continue
        idx = _blocks(by_index.window_mask, by_index.window_mask_indptr, b, n, p)[:real]
        plain = _blocks(meta.custom_mask, meta.mask_indptr, b, n, p)[:real]
        hint = ("ignored" if meta.window_mask is None or bool((got == plain).all())
                else "row-index" if bool((got == idx).all()) else "")
        out.append(_wrong(result.step, rs, b, n, p, window, exp, got, pos, hint))
    return out


def _wrong(step, rs, b, n, p, window, exp, got, pos, hint) -> Wrong:
    leaked, blocked = (got & ~exp).nonzero().tolist(), (exp & ~got).nonzero().tolist()
    row = min(r for r, _ in leaked + blocked)
    row_pos = int(pos[b * n + row])
    depth = rs.tree.depths[row]

    def keys(pairs, prefix: bool) -> list[int]:
        return sorted({c if prefix else c - p for r, c in pairs if r == row and (c < p) == prefix})

    parts = []
    for name, pairs, how in (("leaked", leaked, "visible, though the window hides them"),
                             ("blocked", blocked, "hidden, though inside the window")):
        pk, dk = keys(pairs, True), keys(pairs, False)
        if pk:
            parts.append(f"prefix keys at positions {ranges(pk)} {how}")
        if dk:
            parts.append(f"verify rows {ranges(dk)} {how}")
    edge = row_pos - window + 1
    why = {"ignored": "exactly the tree mask with no window: the sliding layers were given no window mask",
           "row-index": f"exactly the window measured from prefix + row index ({p} + {row} = {p + row}) instead of "
                        f"the row's position prefix + depth ({p} + {depth} = {row_pos})",
           "": "no single window rule explains it"}[hint]
    counts = (f"{len(leaked)} leaked and {len(blocked)} blocked (row, key) pairs over "
              f"{len({r for r, _ in leaked + blocked})} real rows")
    text = (f"request {rs.rid}: the sliding-window mask (W {window}) of row {row} (depth {depth}, position {row_pos}: "
            f"keys from position {max(edge, 0)} on) has {'; '.join(parts)}; {counts}; {why}")
    flat_exp, flat_got = exp[row].int().tolist(), got[row].int().tolist()
    lo = max(0, edge - 2) if edge > 0 else 0
    return Wrong(step, "build_mask", "window_mask", rs.rid, row, flat_exp[lo:lo + 12], flat_got[lo:lo + 12],
                 len(leaked) + len(blocked), text, hint)
