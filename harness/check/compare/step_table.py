"""A verify step's comparison on the device, one host copy per step (issue 22 point 3).

The per-node quantities of every request of a step (compare/metrics.py's NodeMetrics; under the noise-floor
verdict also the twin's and the rounded computation's errors, the engine's distance from its twin and the three
relative L2 errors) are computed on the run's device (the GPU on a GPU run: the engine's rows, the twin's and the
oracle's float64 rows are moved there; the oracle answers on the host, and the engine's loop hands its logits
over on the host too, so computing "where the engine's logits are" ran every float64 softmax of the step on
the host: 1.7-2.3 s per step on the 8B layout at budget 32, topk 4, batch 4), stacked into one table, and
copied to the host once. Per-node `compare_rows` on the host thread was 54% of a GPU run's oracle time at budget 32, topk 4,
batch 4. The numbers are those of the per-node path (tests/unit/test_step_table.py holds them equal).

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.check.compare.metrics import (METRIC_COLUMNS, NodeMetrics, metric_columns, metrics_of, rel_err_column,
                                          rel_l2_column)

# the noise-floor columns after METRIC_COLUMNS; NaN where the run has no twin
NOISE_COLUMNS = ("twin_err", "rounded_err", "twin_dist", "rel_l2", "twin_l2", "rounded_l2")
PADDING_FINITE = len(METRIC_COLUMNS) + len(NOISE_COLUMNS)   # last column: a padding row's logits are finite
WIDTH = PADDING_FINITE + 1


@dataclass(frozen=True)
class RequestRows:
    """One request's rows to compare. engine  # [q_len, vocab] the engine's block (padding rows after the
    tree's); ref  # [num_rows, vocab] float64, the oracle's; twin  # [num_rows, vocab] and
    rounded  # [num_rows, vocab]: the noise-floor verdict's yardsticks, or None."""
    engine: torch.Tensor
    ref: torch.Tensor
    twin: torch.Tensor | None = None
    rounded: torch.Tensor | None = None


@dataclass(frozen=True)
class RowResult:
    """One verify row's quantities on the host: the node's metrics (None for a padding row), the noise-floor
    quantities (None without a twin), and for a padding row whether its logits are finite."""
    metrics: NodeMetrics | None
    twin_err: float | None = None
    rounded_err: float | None = None
    twin_dist: float | None = None
    l2: tuple[float | None, float | None, float | None] = (None, None, None)   # (engine, twin, rounded)
    finite: bool = True


def request_columns(r: RequestRows, device: torch.device) -> torch.Tensor:
    """The request's table on `device`: [q_len, WIDTH] float64, nothing copied to the host."""
    q_len, real = r.engine.shape[0], r.ref.shape[0]
    out = torch.full((q_len, WIDTH), math.nan, dtype=torch.float64, device=device)   # [q_len, WIDTH]
    engine = r.engine.to(device)                                                     # [q_len, vocab]
    if real:
        ref = r.ref.to(device)                                                       # [real, vocab] float64
        out[:real, :len(METRIC_COLUMNS)] = metric_columns(engine[:real], ref)
        if r.twin is not None:
            twin, rounded = r.twin[:real].to(device), r.rounded[:real].to(device)    # [real, vocab] each
            scale = ref.abs().amax(-1).clamp_min(1e-30)                              # [real] max |ref|
            c = len(METRIC_COLUMNS)
            out[:real, c] = rel_err_column(twin, ref)        # the yardsticks' rel_err alone: no softmax of them
            out[:real, c + 1] = rel_err_column(rounded, ref)
            out[:real, c + 2] = (engine[:real].double() - twin.double()).abs().amax(-1) / scale
            for j, x in enumerate((engine[:real], twin, rounded)):
                out[:real, c + 3 + j] = rel_l2_column(x, ref)
    if q_len > real:
        out[real:, PADDING_FINITE] = torch.isfinite(engine[real:]).all(-1).double()
    return out


def step_table(requests: list[RequestRows], device: torch.device | str | None = None) -> list[list[RowResult]]:
    """Every request's rows, computed on `device` (the run's; default: where the engine's logits are) and
    copied to the host in one transfer: per request, one RowResult per verify row."""
    if not requests:
        return []
    device = torch.device(device) if device is not None else requests[0].engine.device
    tables = [request_columns(r, device) for r in requests]
    host = torch.cat(tables).tolist()   # the step's one host copy
    out, start = [], 0
    for r, t in zip(requests, tables):
        rows = host[start:start + t.shape[0]]
        start += t.shape[0]
        out.append([_row(row, i < r.ref.shape[0], r.twin is not None) for i, row in enumerate(rows)])
    return out


def _row(row: list[float], judged: bool, noise: bool) -> RowResult:
    if not judged:
        return RowResult(None, finite=bool(row[PADDING_FINITE]))
    m = metrics_of(row[:len(METRIC_COLUMNS)])
    if not noise:
        return RowResult(m)
    twin_err, rounded_err, twin_dist, *l2 = row[len(METRIC_COLUMNS):PADDING_FINITE]
    return RowResult(m, twin_err, rounded_err, twin_dist, tuple(l2))
