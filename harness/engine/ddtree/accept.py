"""Stage 5, acceptance: the greedy walk down the verified tree.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass

from harness.engine.ddtree.tree import DraftTree


@dataclass(frozen=True)
class Acceptance:
    """rows: accepted rows, root first (the root is always accepted);
    bonus: the target's argmax at the last accepted row, the next root."""

    rows: tuple[int, ...]
    bonus: int

    def __post_init__(self) -> None:
        if not self.rows or self.rows[0] != 0:
            raise ValueError("an acceptance starts at the root row 0")

    @property
    def num_committed(self) -> int:
        return len(self.rows)


def greedy_walk(tree: DraftTree, predicts: list[int]) -> Acceptance:
    """cur = root; while argmax(logits[cur]) is the token of a child of cur,
    move to that child. predicts  # [q_len] argmax per verify row."""
    cur, rows = 0, [0]
    while True:
        nxt = next((c for c in tree.children(cur) if tree.tokens[c] == predicts[cur]), None)
        if nxt is None:
            return Acceptance(tuple(rows), predicts[cur])
        cur = nxt
        rows.append(cur)


def depth_order_parents(tree: DraftTree) -> tuple[int | None, ...]:
    """The tree's parent table renumbered in depth order (breadth-first, pop
    order within a depth), indexed by that numbering: the table a layout that
    sorts rows by depth would hold."""
    order = sorted(range(tree.num_rows), key=lambda r: tree.depths[r])   # stable
    new = {old: i for i, old in enumerate(order)}
    return (None,) + tuple(new[tree.parents[old]] for old in order[1:])


def walk_parents(tree: DraftTree, parents: tuple[int | None, ...], predicts: list[int]) -> Acceptance:
    """The greedy walk with children taken from `parents` (a table over the
    tree's rows, maybe not its own) and tokens and predicts from the verified rows."""
    cur, rows = 0, [0]
    while (nxt := next((c for c in range(1, tree.num_rows)
                        if parents[c] == cur and tree.tokens[c] == predicts[cur]), None)) is not None:
        cur = nxt
        rows.append(cur)
    return Acceptance(tuple(rows), predicts[cur])


def cut_at_stop(tree: DraftTree, acceptance: Acceptance, eos_id: int | None) -> Acceptance:
    """The acceptance ended at the first accepted draft row whose token is the
    end-of-sequence id: the rows before it are committed and the eos becomes the
    bonus (emitted, never cached), so nothing past the stop is committed."""
    if eos_id is None:
        return acceptance
    rows = acceptance.rows
    j = next((j for j in range(1, len(rows)) if tree.tokens[rows[j]] == eos_id), None)
    return acceptance if j is None else Acceptance(rows[:j], eos_id)
