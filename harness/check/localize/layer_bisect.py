"""Layer bisect: re-run the divergent verify forward with the residual
stream captured and find the first layer whose hidden state at the
divergent node leaves tolerance against the oracle's (path_hidden).

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Bisect:
    rel_err_per_layer: list[float]   # entry 0: the embedding output
    first_bad_layer: int | None      # 0 = embedding, i = after decoder layer i-1
    tolerance: float

    def to_record(self) -> dict:
        return {"rel_err_per_layer": self.rel_err_per_layer, "first_bad_layer": self.first_bad_layer,
                "tolerance": self.tolerance}


def capture_hidden(engine, result) -> list[torch.Tensor]:
    """Hidden states [T, hidden] per layer of the round's forward, over the
    very buffers the kernel read (the graph's static ones under --cuda-graph).
    Rewrites the round's K/V with the same values."""
    replay = engine.graph.last if engine.graph is not None else None
    if replay is not None:
        ids, pos, meta = replay.input_ids, replay.positions, replay.meta
    else:
        ids, pos, meta = result.batch.input_ids, result.batch.positions, result.batch.attn
    hidden: list[torch.Tensor] = []
    engine.model.forward(ids, pos, meta, engine.pool, engine.backend, hidden_out=hidden)
    return hidden


def bisect(hidden: list[torch.Tensor], row: int, ref: list[torch.Tensor] | None, tol: float) -> Bisect:
    """ref: the oracle's hidden states of the node's path (None for a padding
    row: then the first non-finite layer is the answer)."""
    errs, first = [], None
    for layer, h in enumerate(hidden):
        got = h[row].double().cpu()
        if ref is None:
            err = 0.0 if bool(torch.isfinite(got).all()) else float("inf")
        else:
            err = float((got - ref[layer]).abs().max()) / max(float(ref[layer].abs().max()), 1e-30)
            err = err if err == err else float("inf")
        errs.append(err)
        if first is None and not err <= tol:
            first = layer
    return Bisect(errs, first, tol)
