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
    tree's); ref  # [num_rows, vocab] float64, the oracle's; rounded  # [num_rows, vocab]: the noise-floor
    verdict's rounded yardstick, or None (no noise columns); twin  # [num_rows, vocab]: its other yardstick for
    every node, or None (computed later for the nodes that need it: twin_table)."""
    engine: torch.Tensor
    ref: torch.Tensor
    twin: torch.Tensor | None = None
    rounded: torch.Tensor | None = None


@dataclass(frozen=True)
class RowResult:
    """One verify row's quantities on the host: the node's metrics (None for a padding row), the noise-floor
    quantities (None without a yardstick; the twin's three None where the twin was not computed), and for a
    padding row whether its logits are finite."""
    metrics: NodeMetrics | None
    twin_err: float | None = None
    rounded_err: float | None = None
    twin_dist: float | None = None
    l2: tuple[float | None, float | None, float | None] = (None, None, None)   # (engine, twin, rounded)
    finite: bool = True


ROWS_PER_PASS = 16   # rows compared together: a few MB of float64 at a 50-150k vocabulary, held in cache across
#                      the ~20 elementwise passes of a row's quantities (whole-step passes each re-read 50 MB)


def request_columns(r: RequestRows, device: torch.device) -> torch.Tensor:
    """The request's table on `device`: [q_len, WIDTH] float64, nothing copied to the host. Every quantity is
    of one row alone, so the rows are taken ROWS_PER_PASS at a time (the same numbers, in cache)."""
    q_len, real = r.engine.shape[0], r.ref.shape[0]
    out = torch.full((q_len, WIDTH), math.nan, dtype=torch.float64, device=device)   # [q_len, WIDTH]
    c = len(METRIC_COLUMNS)
    for a in range(0, real, ROWS_PER_PASS):
        rows = slice(a, min(a + ROWS_PER_PASS, real))
        engine, ref = r.engine[rows].to(device), r.ref[rows].to(device)           # [k, vocab] each
        out[rows, :c] = metric_columns(engine, ref)
        if r.rounded is not None:
            rounded = r.rounded[rows].to(device)                                   # [k, vocab]
            out[rows, c + 1] = rel_err_column(rounded, ref)   # the yardsticks' rel_err alone: no softmax of them
            out[rows, c + 3] = rel_l2_column(engine, ref)
            out[rows, c + 5] = rel_l2_column(rounded, ref)
        if r.twin is not None:
            out[rows, [c, c + 2, c + 4]] = twin_columns(engine, ref, r.twin[rows].to(device))
    if q_len > real:
        out[real:, PADDING_FINITE] = torch.isfinite(r.engine[real:].to(device)).all(-1).double()
    return out


def twin_columns(engine: torch.Tensor, ref: torch.Tensor, twin: torch.Tensor) -> torch.Tensor:
    """The twin's quantities of k rows on ref's device: [k, 3] float64 (twin_err, twin_dist, twin_l2).
    engine  # [k, vocab] any float dtype; ref  # [k, vocab] float64; twin  # [k, vocab]."""
    twin = twin.to(ref.device)
    scale = ref.abs().amax(-1).clamp_min(1e-30)                                     # [k] max |ref|
    dist = (engine.to(ref.device, torch.float64) - twin.double()).abs().amax(-1) / scale
    return torch.stack([rel_err_column(twin, ref), dist, rel_l2_column(twin, ref)], -1)


def twin_table(engine: torch.Tensor, ref: torch.Tensor, twin: torch.Tensor, device) -> list[tuple[float, float, float]]:
    """twin_columns of k rows computed on `device`, ROWS_PER_PASS at a time, copied to the host once:
    (twin_err, twin_dist, twin_l2) per row."""
    parts = [twin_columns(engine[a:a + ROWS_PER_PASS].to(device), ref[a:a + ROWS_PER_PASS].to(device),
                          twin[a:a + ROWS_PER_PASS]) for a in range(0, ref.shape[0], ROWS_PER_PASS)]
    return [tuple(x) for x in torch.cat(parts).tolist()] if parts else []


def node_errors(requests: list[RequestRows], device: torch.device | str) -> list[list[tuple[float, float]]]:
    """Per request, per node: (rel_err, rounded_err), the two numbers step_table holds for them (the same
    rel_err_column, rows taken ROWS_PER_PASS at a time), without the other columns; one host copy. Each request
    must carry its rounded yardstick."""
    device = torch.device(device)
    cols = []
    for r in requests:
        if r.rounded is None:
            raise ValueError("node_errors reads the rounded yardstick's error: a request without one")
        real = r.ref.shape[0]   # the engine's block has its padding rows after these
        for a in range(0, real, ROWS_PER_PASS):
            rows = slice(a, min(a + ROWS_PER_PASS, real))
            ref = r.ref[rows].to(device)                                                   # [k, vocab]
            cols.append(torch.stack([rel_err_column(r.engine[rows], ref), rel_err_column(r.rounded[rows], ref)],
                                    -1))                                                   # [k, 2]
    host = torch.cat(cols).tolist() if cols else []
    out, start = [], 0
    for r in requests:
        out.append([tuple(x) for x in host[start:start + r.ref.shape[0]]])
        start += r.ref.shape[0]
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
        out.append([_row(row, i < r.ref.shape[0], r.rounded is not None, r.twin is not None)
                    for i, row in enumerate(rows)])
    return out


def _row(row: list[float], judged: bool, noise: bool, twin: bool) -> RowResult:
    if not judged:
        return RowResult(None, finite=bool(row[PADDING_FINITE]))
    m = metrics_of(row[:len(METRIC_COLUMNS)])
    if not noise:
        return RowResult(m)
    twin_err, rounded_err, twin_dist, l2, twin_l2, rounded_l2 = row[len(METRIC_COLUMNS):PADDING_FINITE]
    if not twin:
        return RowResult(m, None, rounded_err, None, (l2, None, rounded_l2))
    return RowResult(m, twin_err, rounded_err, twin_dist, (l2, twin_l2, rounded_l2))
