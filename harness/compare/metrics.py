"""Per-node comparison of engine logits against the oracle's."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NodeMetrics:
    rel_err: float    # max |engine - ref| / max |ref|
    top1_agree: bool
    kl: float         # KL(ref || engine), natural log
    ref_gap: float    # (ref top-1 - ref top-2) / max |ref|: small means a near tie
    finite: bool
    ref_scale: float  # max |ref|

    def verdict(self, tol: float) -> str:
        if not self.finite or self.rel_err > tol:
            return "diverge"
        return "match" if self.top1_agree else "near-tie"


def compare_node(engine: torch.Tensor, ref: torch.Tensor) -> NodeMetrics:
    """engine  # [vocab] any float dtype; ref  # [vocab] float64."""
    e = engine.double()
    finite = bool(torch.isfinite(e).all())
    scale = float(ref.abs().max().clamp_min(1e-30))
    top2 = torch.topk(ref, 2).values if ref.numel() > 1 else torch.stack([ref.max(), ref.max()])
    gap = float(top2[0] - top2[1]) / scale
    if not finite:
        return NodeMetrics(float("inf"), False, float("inf"), gap, False, scale)
    rel = float((e - ref).abs().max()) / scale
    log_p, log_q = torch.log_softmax(ref, -1), torch.log_softmax(e, -1)
    kl = float((log_p.exp() * (log_p - log_q)).sum())
    return NodeMetrics(rel, int(e.argmax()) == int(ref.argmax()), max(kl, 0.0), gap, True, scale)
