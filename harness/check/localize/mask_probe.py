"""Mask probe: recover, black-box, the visibility an attention backend
actually applied to a verify batch, and diff it against the tree's ancestor
mask.

Queries and keys are zero, so every visible key gets the same softmax
weight; each key's value is one-hot in its own channel (head_dim channels a
pass, several passes when a request has more keys than channels). A key
contributed to a row iff that row's output is nonzero in the key's channel.
The metadata is the batch's own (for graph runs the static buffers the
replay read), except kv_indices, which is swapped for distinct scratch slots
so every prefix column owns its value whatever slots the real indices hold.


Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from harness.engine.ddtree.tree import DraftTree
from harness.check.localize.audits import ranges
from harness.engine.ddtree.verify_inputs import AttnMetadata


@dataclass(frozen=True)
class Visibility:
    """What one request's rows saw: effective  # [rows, prefix+rows] bool;
    empty  # [rows] bool, rows that saw no key (NaN or zero output)."""

    prefix_len: int
    effective: torch.Tensor
    empty: torch.Tensor


def probe_visibility(backend, meta: AttnMetadata, heads: int, kv_heads: int, head_dim: int,
                     dtype: torch.dtype = torch.float32, device: str = "cpu") -> list[Visibility]:
    """One Visibility per request of `meta` (batch-padding dummies included)."""
    qo, kvp = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
    bs, t = meta.batch_size, qo[-1]
    n_idx = meta.kv_indices.numel()
    cols = [kvp[b + 1] - kvp[b] + qo[b + 1] - qo[b] for b in range(bs)]
    probe_meta = probe_slots(meta, device)
    q = torch.zeros((t, heads, head_dim), dtype=dtype, device=device)
    k = torch.zeros((t, kv_heads, head_dim), dtype=dtype, device=device)
    k_buf = torch.zeros((n_idx + 1 + t, kv_heads, head_dim), dtype=dtype, device=device)
    seen = [torch.zeros((qo[b + 1] - qo[b], cols[b]), dtype=torch.bool) for b in range(bs)]
    empty = [torch.zeros(qo[b + 1] - qo[b], dtype=torch.bool) for b in range(bs)]
    for start in range(0, max(cols), head_dim):
        v = torch.zeros((t, kv_heads, head_dim), dtype=dtype, device=device)
        v_buf = torch.zeros((n_idx + 1 + t, kv_heads, head_dim), dtype=dtype, device=device)
        for b in range(bs):
            p = kvp[b + 1] - kvp[b]
            for c in range(start, min(cols[b], start + head_dim)):
                if c < p:
                    v_buf[1 + kvp[b] + c, :, c - start] = 1.0
                else:
                    v[qo[b] + c - p, :, c - start] = 1.0
        v_buf[n_idx + 1:] = v      # the rows' K/V already saved at (the probe's) out_cache_loc
        o = backend.forward(q, k, v, 0, k_buf, v_buf, probe_meta).float().cpu()[:, 0]  # [T, head_dim]
        for b in range(bs):
            rows = o[qo[b]:qo[b + 1]]
            width = min(cols[b], start + head_dim) - start
            if width <= 0:
                continue
            empty[b] |= ~torch.isfinite(rows).all(-1)
            seen[b][:, start:start + width] = rows[:, :width].nan_to_num(0.0) > 0.5 / cols[b]
    for b in range(bs):
        empty[b] |= ~seen[b].any(-1)
    return [Visibility(kvp[b + 1] - kvp[b], seen[b], empty[b]) for b in range(bs)]


def probe_slots(meta: AttnMetadata, device: str) -> AttnMetadata:
    """meta over a probe pool: the prefix at slots 1..n (kv_indices), the verify rows' K/V saved at the
    slots after it (out_cache_loc), so a backend reading either from the pool or from its arguments sees
    the probe's keys (the kernel's own slots are not judged here: the KV audit does that)."""
    n, t = meta.kv_indices.numel(), int(meta.qo_indptr[-1])
    return replace(meta, kv_indices=torch.arange(1, n + 1, dtype=torch.int64, device=device),
                   out_cache_loc=torch.arange(n + 1, n + 1 + t, dtype=meta.out_cache_loc.dtype, device=device))


def ancestor_mask(tree: DraftTree, prefix_len: int) -> torch.Tensor:
    """What the tree implies  # [q_len, prefix+q_len]: every row sees the
    prefix; a real row its root-to-row path; a padding row its diagonal."""
    n = tree.q_len
    m = torch.zeros((n, prefix_len + n), dtype=torch.bool)
    m[:, :prefix_len] = True
    for row in range(tree.num_rows):
        m[row, [prefix_len + a for a in tree.ancestors(row)]] = True
    for row in range(tree.num_rows, n):
        m[row, prefix_len + row] = True
    return m


@dataclass(frozen=True)
class MaskDiff:
    """The probe of one request against its tree; pairs are (row, column)."""

    request: int
    prefix_len: int
    expected: torch.Tensor            # [q_len, prefix+q_len] bool
    effective: torch.Tensor           # [q_len, prefix+q_len] bool
    leaked: list[tuple[int, int]]     # real rows only: effective, not expected
    blocked: list[tuple[int, int]]    # real rows only: expected, not effective
    empty_rows: list[int]             # rows (padding included) that saw no key
    key_roles: list[str]
    key_slots: list[int]
    ignored_regions: list[str]
    parents: tuple[int | None, ...] = ()      # the tree's, real rows (empty for a batch-padding dummy)
    other_request_cols: tuple[int, ...] = ()  # columns whose slot belongs to another request of the batch

    @property
    def clean(self) -> bool:
        return not (self.leaked or self.blocked or self.empty_rows)

    def to_record(self) -> dict:
        return {"request": self.request, "rows": int(self.expected.shape[0]), "cols": int(self.expected.shape[1]),
                "prefix_len": self.prefix_len, "expected": self.expected.int().tolist(),
                "effective": self.effective.int().tolist(), "leaked": [list(x) for x in self.leaked],
                "blocked": [list(x) for x in self.blocked], "empty_rows": self.empty_rows,
                "key_roles": self.key_roles, "key_slots": self.key_slots,
                "ignored_regions": self.ignored_regions,
                "changes": [{"change": ch, "row": r, "col": c, "role": pair_role(self, r, c)}
                            for ch, pairs in (("gained", self.leaked), ("lost", self.blocked)) for r, c in pairs]}


def key_roles(tree: DraftTree, prefix_len: int) -> list[str]:
    return ([f"prefix:{j}" for j in range(prefix_len)] + ["root"]
            + [f"node:{i}" if i < tree.num_rows else f"padding:{i}" for i in range(1, tree.q_len)])


def diff_request(request: int, vis: Visibility, tree: DraftTree, key_slots: list[int],
                 mask_regions: frozenset[str], other_request_slots: frozenset[int] = frozenset()) -> MaskDiff:
    """other_request_slots: the slots the batch's other requests own (their
    committed prefix and their verify rows); a key column holding one of them
    has the role "other request"."""
    p = vis.prefix_len
    expected = ancestor_mask(tree, p)
    effective = vis.effective
    read = torch.ones_like(expected)
    ignored = sorted({"prefix", "draft"} - set(mask_regions))
    if "prefix" in ignored:
        read[:, :p] = False
    if effective.shape != expected.shape:
        raise ValueError(f"probe of request {request}: shape {tuple(effective.shape)} != {tuple(expected.shape)}")
    real = torch.zeros_like(expected)
    real[:tree.num_rows] = True
    leaked = (effective & ~expected & read & real).nonzero().tolist()
    blocked = (~effective & expected & read & real).nonzero().tolist()
    return MaskDiff(request, p, expected, effective, [tuple(x) for x in leaked], [tuple(x) for x in blocked],
                    vis.empty.nonzero().flatten().tolist(), key_roles(tree, p), key_slots, ignored, tree.parents,
                    tuple(c for c, s in enumerate(key_slots) if s in other_request_slots))


ROLES = ("prefix", "ancestor", "itself", "sibling", "descendant", "other branch", "padding", "other request")


def _path(parents: tuple[int | None, ...], row: int) -> list[int]:
    out = [row]
    while (p := parents[out[-1]]) is not None:
        out.append(p)
    return out


def pair_role(d: MaskDiff, row: int, col: int) -> str:
    """The role key `col` plays for real row `row` in the tree: one of ROLES.
    "other branch" is a node neither on the row's path, below it, nor a
    sibling (a cousin)."""
    p = d.prefix_len
    if col in d.other_request_cols:
        return "other request"
    if col < p:
        return "prefix"
    k = col - p
    if not d.parents or k >= len(d.parents):
        return "padding"
    if k == row:
        return "itself"
    if k in _path(d.parents, row):
        return "ancestor"
    if row in _path(d.parents, k):
        return "descendant"
    return "sibling" if d.parents[k] == d.parents[row] else "other branch"


def _key_label(d: MaskDiff, role: str, cols: list[int]) -> str:
    cols = sorted(cols)
    slots = ranges(sorted(d.key_slots[c] for c in cols)) if d.key_slots else "?"
    many = "s" if len(cols) > 1 else ""
    prefix = [c for c in cols if c < d.prefix_len]
    if len(prefix) == len(cols):
        return f"{role} key{many} at prefix position{many} {ranges(cols)} (slot{many} {slots})"
    return f"{role} key{many} {ranges([c - d.prefix_len for c in cols])} (slot{many} {slots})"


def visibility_changes(d: MaskDiff, limit: int = 6) -> str:
    """Which real rows gained or lost which keys, grouped by the key's role:
    "row 5 gained sibling key 4 (slot 209); row 7 lost ancestor key 2 (slot 207)"."""
    groups: dict[tuple[str, str], dict[int, list[int]]] = {}
    for change, pairs in (("gained", d.leaked), ("lost", d.blocked)):
        for r, c in pairs:
            groups.setdefault((change, pair_role(d, r, c)), {}).setdefault(r, []).append(c)
    items, left = [], 0
    for (change, role), rows in groups.items():
        same: dict[tuple[int, ...], list[int]] = {}   # rows that changed in the same keys, named together
        for r, cols in sorted(rows.items()):
            same.setdefault(tuple(sorted(cols)), []).append(r)
        for cols, rs in same.items():
            if len(items) < limit:
                who = f"row {rs[0]}" if len(rs) == 1 else f"rows {ranges(rs)}"
                items.append(f"{who} {change} {_key_label(d, role, list(cols))}")
            else:
                left += 1
    more = f"; and {left} more groups of rows" if left else ""
    n = len(d.leaked) + len(d.blocked)
    return (f"the applied mask differs from the tree's ancestor mask in {n} (row, key) pair{'s' if n > 1 else ''} "
            f"({len(d.leaked)} gained, {len(d.blocked)} lost): " + "; ".join(items) + more)


def flat_shift_explains(diff: MaskDiff, num_rows: int) -> int | None:
    """The offset s (elements, nonzero) such that the request's expected
    block, moved by s along the flat buffer the kernel reads, gives the
    effective mask on the real rows, if one does."""
    p, n = diff.prefix_len, diff.expected.shape[0]
    read = torch.ones_like(diff.expected)
    if "prefix" in diff.ignored_regions:
        read[:, :p] = False
    read[num_rows:] = False
    flat, want, mask = diff.expected.reshape(-1), diff.effective.reshape(-1), read.reshape(-1)
    size, wrong = flat.numel(), (flat != want) & mask   # every wrong element must be one the shift explains
    reach = min(size - 1, 2 * (p + n))   # a shift is by at most two rows; further is a different layout
    for s in sorted(range(-reach, reach + 1), key=abs):
        if s == 0:
            continue
        moved, judged = torch.zeros_like(flat), mask.clone()   # elements moved in from outside the block: not judged
        if s > 0:
            moved[s:], judged[:s] = flat[:size - s], False
        else:
            moved[:size + s], judged[size + s:] = flat[-s:], False
        if bool((moved == want)[judged].all()) and not bool((wrong & ~judged).any()):
            return s
    return None


def derived_parents(diff: MaskDiff, num_rows: int) -> list[int] | None:
    """If the effective draft part of the real rows is the ancestor mask of
    some numbering of a tree, the parent of each row in that numbering
    (-1 for the root); else None."""
    p = diff.prefix_len
    sets = [set(diff.effective[r, p:p + num_rows].nonzero().flatten().tolist()) for r in range(num_rows)]
    parents = []
    for r, s in enumerate(sets):
        if r not in s or 0 not in s:
            return None
        others = [a for a in s if a != r]
        if not others:
            parents.append(-1)
            continue
        par = max(others, key=lambda a: len(sets[a]))
        if sets[par] | {r} != s:
            return None
        parents.append(par)
    return parents


def row_stride_explains(diff: MaskDiff, num_rows: int) -> int | None:
    """The layout width w (prefix + w columns a row) whose rows, read back at
    the kernel's stride prefix + q_len, give the effective mask, if one does."""
    p, n = diff.prefix_len, diff.expected.shape[0]
    read = torch.ones_like(diff.expected)
    if "prefix" in diff.ignored_regions:
        read[:, :p] = False
    read[num_rows:] = False
    for w in range(1, n):
        flat = torch.zeros(n * (p + n), dtype=torch.bool)
        flat[:n * (p + w)] = diff.expected[:, :p + w].reshape(-1)
        if bool((flat.view(n, p + n) == diff.effective)[read].all()):
            return w
    return None


def dummy_request(request: int, vis: Visibility, key_slots: list[int]) -> MaskDiff:
    """A graph batch-padding request: no tree; the runner lets it see every key."""
    n, p = vis.effective.shape[0], vis.prefix_len
    roles = [f"prefix:{j}" for j in range(p)] + [f"dummy:{i}" for i in range(n)]
    return MaskDiff(request, p, torch.ones_like(vis.effective), vis.effective, [], [],
                    vis.empty.nonzero().flatten().tolist(), roles, key_slots, [])
