"""Per-node comparison of engine logits against the oracle's.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
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


def engine_block(logits: torch.Tensor, rows: int, vocab: int) -> tuple[torch.Tensor, str | None]:
    """The engine's logits for one request's verify rows as [rows, vocab], and what was wrong with their
    shape (None: nothing). A block of another shape is the engine's output, so a divergence, never an
    error of the check: rows the engine did not produce are NaN (non-finite, so divergent), and a block
    longer than the tree, or of another vocabulary, is NaN throughout (no row of it can be trusted
    to be the node it stands for). logits  # [n, vocab'] as the engine returned it."""
    if logits.dim() == 2 and tuple(logits.shape) == (rows, vocab):
        return logits, None
    out = torch.full((rows, vocab), float("nan"), dtype=torch.float32, device=logits.device)  # [rows, vocab]
    if logits.dim() == 2 and logits.shape[0] < rows and logits.shape[1] == vocab:
        out[:logits.shape[0]] = logits
    return out, (f"the engine returned a logits block of shape {list(logits.shape)} for {rows} verify rows "
                 f"of a {vocab}-token vocabulary; rows it did not produce are judged non-finite")


def compare_node(engine: torch.Tensor, ref: torch.Tensor) -> NodeMetrics:
    """engine  # [vocab] any float dtype; ref  # [vocab] float64."""
    return compare_rows(engine[None], ref[None])[0]


def compare_rows(engine: torch.Tensor, ref: torch.Tensor) -> list[NodeMetrics]:
    """One NodeMetrics per row, computed for all rows at once on ref's device
    (a 128k vocabulary is then one pass per quantity, not one host round trip
    per node and quantity). engine  # [n, vocab] any float dtype;
    ref  # [n, vocab] float64."""
    if engine.shape != ref.shape or ref.dim() != 2:
        raise ValueError(f"compare_rows needs two [n, vocab] tensors, got {tuple(engine.shape)} and {tuple(ref.shape)}")
    if ref.shape[0] == 0:
        return []
    return [metrics_of(row) for row in metric_columns(engine, ref).tolist()]


# the columns of metric_columns, in NodeMetrics' order
METRIC_COLUMNS = ("rel_err", "top1_agree", "kl", "ref_gap", "finite", "ref_scale")


def metric_columns(engine: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """NodeMetrics' quantities of every row as one float64 tensor on ref's device, nothing copied to the host
    (booleans as 0 and 1): [n, 6] in METRIC_COLUMNS' order. engine  # [n, vocab] any float dtype;
    ref  # [n, vocab] float64, n >= 1."""
    e = engine.to(ref.device, torch.float64)                                  # [n, vocab]
    finite = torch.isfinite(e).all(-1)                                        # [n]
    scale = ref.abs().amax(-1).clamp_min(1e-30)                               # [n] max |ref|
    top2 = torch.topk(ref, 2, -1).values if ref.shape[-1] > 1 else ref.amax(-1, keepdim=True).expand(-1, 2)
    gap = (top2[:, 0] - top2[:, 1]) / scale                                   # [n]
    rel = _rel_err(e, ref, scale, finite)                                     # [n]
    log_p, log_q = torch.log_softmax(ref, -1), torch.log_softmax(e, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)               # [n] KL(ref || engine)
    agree = e.argmax(-1) == ref.argmax(-1)                                    # [n]
    kl = torch.where(finite, kl, torch.full_like(kl, float("inf")))
    agree = agree & finite
    return torch.stack([rel, agree.double(), kl, gap, finite.double(), scale], -1)   # [n, 6]


def rel_err_column(engine: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """metric_columns' rel_err column alone, [n] float64 on ref's device: what a yardstick's rows (the twin's,
    the rounded computation's) are judged by, without the softmaxes, top-2 and argmax of the other columns."""
    e = engine.to(ref.device, torch.float64)                                  # [n, vocab]
    return _rel_err(e, ref, ref.abs().amax(-1).clamp_min(1e-30), torch.isfinite(e).all(-1))


def _rel_err(e: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """max |e - ref| / scale per row, inf where a row of e is not finite: [n]."""
    rel = (e - ref).abs().amax(-1) / scale                                    # [n]
    return torch.where(finite, rel, torch.full_like(rel, float("inf")))


def metrics_of(row: list[float]) -> NodeMetrics:
    """A row of metric_columns, on the host, as NodeMetrics."""
    rel, agree, kl, gap, finite, scale = row
    return NodeMetrics(rel, bool(agree), kl, gap, bool(finite), scale)


def rel_l2(engine: torch.Tensor, ref: torch.Tensor) -> list[float]:
    """||engine - ref||_2 / ||ref||_2 per row: the error over the whole logit
    vector, not its largest entry. engine  # [n, vocab] any float dtype;
    ref  # [n, vocab] float64. A correct low-precision node's error is spread
    over the vocabulary; the largest of 50k correlated entries is a noisy draw
    of it, the norm a steady one (harness/verdict/noise_floor.py)."""
    if engine.shape != ref.shape or ref.dim() != 2:
        raise ValueError(f"rel_l2 needs two [n, vocab] tensors, got {tuple(engine.shape)} and {tuple(ref.shape)}")
    return rel_l2_column(engine, ref).tolist()


def rel_l2_column(engine: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """rel_l2 on ref's device: [n] float64."""
    e = engine.to(ref.device, torch.float64)                                  # [n, vocab]
    err = torch.linalg.vector_norm(e - ref, dim=-1)                           # [n]
    return err / torch.linalg.vector_norm(ref, dim=-1).clamp_min(1e-30)
