"""Acceptance as a measured quantity: how many tokens each verify step
commits, and how often the walk goes one level deeper.

* accepted length of a (step, request): the accepted rows, root included,
  i.e. the accepted draft tokens plus the bonus token (SGLang's "accept
  length"): the tokens the step emits.
* acceptance at depth d: among the (step, request) pairs whose walk reached
  depth d - 1 at a row that has at least one child (a draft to accept), the
  fraction whose walk reached depth d.


Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceTally:
    """Accumulates over a run (check-internal, mutable)."""

    lengths: list[int] = field(default_factory=list)
    offered: list[int] = field(default_factory=list)   # [depth - 1] pairs with a draft to accept at depth
    reached: list[int] = field(default_factory=list)   # [depth - 1] pairs whose walk reached depth

    def add(self, tree, acceptance) -> None:
        """tree: a DraftTree; acceptance: its Acceptance (rows root first)."""
        rows = list(acceptance.rows)
        self.lengths.append(len(rows))
        has_child = {p for p in tree.parents[1:] if p is not None}
        for depth, row in enumerate(rows, start=1):  # row sits at depth - 1
            if row not in has_child:
                break
            while len(self.offered) < depth:
                self.offered.append(0)
                self.reached.append(0)
            self.offered[depth - 1] += 1
            self.reached[depth - 1] += depth < len(rows)

    @property
    def mean_length(self) -> float | None:
        return sum(self.lengths) / len(self.lengths) if self.lengths else None

    @property
    def by_depth(self) -> list[float]:
        """Acceptance at depth 1, 2, ... (as long as some walk was offered that depth)."""
        return [r / o for r, o in zip(self.reached, self.offered)]


@dataclass(frozen=True)
class AcceptanceBaseline:
    """A case's floor for a matrix table: its settings' mean accepted length
    must not fall below `mean_accepted_length - band`."""

    mean_accepted_length: float
    band: float

    def __post_init__(self) -> None:
        if not self.mean_accepted_length >= 1.0:
            raise ValueError("a mean accepted length is at least 1 (the bonus token)")
        if not self.band >= 0.0:
            raise ValueError("the band must be >= 0")

    @property
    def floor(self) -> float:
        return self.mean_accepted_length - self.band

    def shortfall(self, measured: float | None) -> str | None:
        """Why `measured` fails the baseline, or None."""
        if measured is None:
            return "no verify step ran, so no accepted length was measured"
        if measured < self.floor:
            return (f"mean accepted length {measured:.3f} fell below the baseline {self.mean_accepted_length:g} "
                    f"- band {self.band:g} = {self.floor:g}")
        return None
