"""Which keys a row gained or lost, by the key's role relative to the row:
prefix, self, ancestor, descendant, sibling (same parent), off-path (another
branch of the tree), padding; and, for KV slots, whose slot it is (this
request's position, another request's, a free one).

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

import torch

from harness.engine.ddtree.tree import DraftTree
from harness.check.localize.audits import ranges

ROLES = ("prefix", "self", "ancestor", "descendant", "sibling", "off-path", "padding")


def key_role(tree: DraftTree, prefix_len: int, row: int, col: int) -> str:
    if col < prefix_len:
        return "prefix"
    j = col - prefix_len
    if j >= tree.num_rows:
        return "self" if j == row else "padding"
    if row >= tree.num_rows:
        return "node"          # a padding row's view of a real row's key
    if j == row:
        return "self"
    if j in tree.ancestors(row):
        return "ancestor"
    if row in tree.ancestors(j):
        return "descendant"
    return "sibling" if tree.parents[j] == tree.parents[row] else "off-path"


def role_diff(expected: torch.Tensor, found: torch.Tensor, tree: DraftTree, prefix_len: int,
              judged: torch.Tensor | None = None) -> dict:
    """expected, found  # [q_len, prefix+q_len] bool; judged  # same shape, the entries to compare.
    {"gained": {role: {"rows": [...], "pairs": n}}, "lost": {...}}"""
    judged = torch.ones_like(expected) if judged is None else judged
    out: dict = {"gained": {}, "lost": {}}
    for side, pairs in (("gained", found & ~expected & judged), ("lost", expected & ~found & judged)):
        for r, c in pairs.nonzero().tolist():
            e = out[side].setdefault(key_role(tree, prefix_len, r, c), {"rows": [], "pairs": 0})
            e["pairs"] += 1
            if r not in e["rows"]:
                e["rows"].append(r)
    return out


def role_sentence(diff: dict) -> str:
    """"rows 1-3 gained padding keys (6 pairs); row 4 lost ancestor keys (2 pairs)"."""
    parts = []
    for side in ("gained", "lost"):
        for role in sorted(diff[side], key=lambda x: ROLES.index(x) if x in ROLES else len(ROLES)):
            e = diff[side][role]
            rows = sorted(e["rows"])
            parts.append(f"{'row' if len(rows) == 1 else 'rows'} {ranges(rows)} {side} {role} keys ({e['pairs']} "
                         f"pair{'s' if e['pairs'] != 1 else ''})")
    return "; ".join(parts)


def slot_owner(slot: int, owners: dict[int, tuple[int, int]], rid: int) -> str:
    """owners: slot -> (request id, position) of every committed slot."""
    if slot not in owners:
        return f"slot {slot} (no committed position)"
    r, pos = owners[slot]
    return f"slot {slot} ({'this request' if r == rid else f'request {r}'}'s position {pos})"
