"""Router near ties (issue 24): in low precision a MoE router whose best
unchosen expert is within rounding of its last chosen one may pick another
expert on the engine than on the float64 oracle. The node's logits then move
by far more than the tolerance, yet no mask, slot or kernel is wrong.

A divergent node is a `router-tie` only if its divergence starts at a router
flip (a layer where the engine's expert set for the node, or for a node on
its root path, or for a committed position of its prefix that flipped
earlier, differs from the oracle's) and every such flip lies inside the
noise on both sides, or in a later layer than a flip inside the noise on
the same root path (its input moved: on tiny-kimi-k2 in bf16 a layer-1
flip of margin 2.3e-4 moved the same row's layer-2 scores to a flip of
margin 0.093, and the run false-alarmed on an H100 and on the CPU). A
flip inside the noise is one where the oracle's margin and the engine's own gap are each
below NOISE_EPS x eps(dtype) x the selection scores' scale. A flip with
either side outside the noise stays a divergence; so does a divergent node
with no flip at all.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

NOISE_EPS = 4.0   # the noise band, in units of the run dtype's machine epsilon (times the scores' scale)


@dataclass(frozen=True)
class Flip:
    row: int          # the tree row (or -1 - position for a committed prefix position)
    layer: int        # the MoE layer's index in the model
    oracle_margin: float
    engine_gap: float
    in_noise: bool


def noise_band(dtype: torch.dtype, scale: float = 1.0) -> float:
    """NOISE_EPS x eps(dtype) x the scores' scale (sigmoid scores plus the correction bias: about 1)."""
    return NOISE_EPS * torch.finfo(dtype).eps * max(scale, 1.0)


def flips(engine_experts: torch.Tensor, engine_gap: torch.Tensor, oracle_experts: torch.Tensor,
          oracle_margin: torch.Tensor, layers: tuple[int, ...], rows: list[int], band: float) -> list[Flip]:
    """The router flips among `rows`: engine_experts, oracle_experts  # [n, L, k] sorted; engine_gap,
    oracle_margin  # [n, L]; layers  # the L MoE layers' indices."""
    out = []
    for r in rows:
        for j, layer in enumerate(layers):
            if not torch.equal(engine_experts[r, j].cpu(), oracle_experts[r, j].cpu()):
                m, g = float(oracle_margin[r, j]), float(engine_gap[r, j])
                out.append(Flip(r, layer, m, g, m < band and g < band))
    return out


@dataclass
class RouterTies:
    """Per request: the committed positions whose routing flipped inside the noise (their cached latents
    are the other expert's, so every later node reading them inherits the tie)."""

    band: float
    tied_positions: dict[int, set[int]] = field(default_factory=dict)

    def judge(self, rid: int, path_flips: list[Flip]) -> str | None:
        """"router-tie", "router-flip" (a flip outside the noise: a divergence) or None (no flip to name)."""
        if path_flips:
            tied = [f.layer for f in path_flips if f.in_noise]
            first = min(tied) if tied else None
            inherited = lambda f: first is not None and f.layer > first  # noqa: E731
            return "router-tie" if all(f.in_noise or inherited(f) for f in path_flips) else "router-flip"
        return "router-tie" if self.tied_positions.get(rid) else None

    def commit(self, rid: int, prefix_len: int, accepted_rows: list[int], tied_rows: set[int]) -> None:
        """Accepted rows whose routing flipped inside the noise become tied committed positions."""
        for j, row in enumerate(accepted_rows):
            if row in tied_rows:
                self.tied_positions.setdefault(rid, set()).add(prefix_len + j)


class StepRouting:
    """One request step's router-tie judgement: the oracle's routing of the tree asked for once, at the
    first divergent node, and only when the engine recorded its own (a MoE model, no graph replay)."""

    def __init__(self, rs, oracle, ties: RouterTies) -> None:
        self.rs, self.oracle, self.ties = rs, oracle, ties
        self._oracle_routing = None
        self.tied_rows: set[int] = set()

    def _ask(self):
        if self._oracle_routing is None:
            tree = self.rs.tree
            parents = [-1] + [int(x) for x in tree.parents[1:]]
            self._oracle_routing = self.oracle.routing(list(self.rs.prefix), list(tree.tokens), parents)
        return self._oracle_routing

    def verdict(self, row: int) -> str | None:
        """For a divergent tree row: "router-tie", "router-flip" or None (no routing to judge by, or no flip)."""
        if self.rs.routing is None or getattr(self.oracle, "routing", None) is None:
            return None
        ref = self._ask()
        if ref is None:
            return None
        experts, gap = self.rs.routing
        path = list(self.rs.tree.ancestors(row))
        found = flips(experts, gap, ref.experts, ref.margin, tuple(ref.layers), path, self.ties.band)
        out = self.ties.judge(self.rs.rid, found)
        if out == "router-tie":
            self.tied_rows.update(f.row for f in found)
        return out

    def commit(self) -> None:
        self.ties.commit(self.rs.rid, len(self.rs.prefix), list(self.rs.acceptance.rows), self.tied_rows)
