"""Stage 5, acceptance: the greedy walk down the verified tree."""
from __future__ import annotations

from dataclasses import dataclass

from harness.ddtree.tree import DraftTree


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


def cut_at_stop(tree: DraftTree, acceptance: Acceptance, eos_id: int | None) -> Acceptance:
    """The acceptance ended at the first accepted draft row whose token is the
    end-of-sequence id: the rows before it are committed and the eos becomes the
    bonus (emitted, never cached), so nothing past the stop is committed."""
    if eos_id is None:
        return acceptance
    rows = acceptance.rows
    j = next((j for j in range(1, len(rows)) if tree.tokens[rows[j]] == eos_id), None)
    return acceptance if j is None else Acceptance(rows[:j], eos_id)
