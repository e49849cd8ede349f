"""A verify step's table, and the causal twins its noise-floor verdicts need, computed side by side.

The twin only raises a node's noise scale, so which nodes need it (NoiseFloorRule.needs_twin) follows from two
numbers per node: the engine's error and the rounded yardstick's (compare/step_table.py node_errors, the same
numbers the table holds). Those read, the twins' forward (the engine's computation again, on the engine's
thread: check/causal_twin.py) runs while the rest of the table (softmaxes, top-2, KL) is computed: on the CPU
with two threads or more they run at once, one thread each; elsewhere one after the other. Either way the
rows are the same: the twin's quantities (twin_err, twin_dist, twin_l2) go into the asked nodes' rows, the
other nodes keep twin_err None.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, Sequence

import torch

from harness.check.compare.step_table import RequestRows, RowResult, node_errors, step_table, twin_table

Asks = list[tuple[int, list[int]]]   # (request index in the step, the nodes whose twin is needed)


def table_with_twins(p, steps: Sequence, judged: list[RequestRows]) -> list[list[RowResult]]:
    """The step's table (step_table), each request's rows with their twins' quantities for the nodes whose
    verdict the twin can change. p: the run's Prepared (its rule, twin and settings); steps: the engine's
    RequestStep per request (prefix, tree), judged: their RequestRows, in the same order."""
    device = p.settings.device
    if p.rule is None:
        return step_table(judged, device)
    asks = twin_asks(p.rule, judged, device)
    if not asks:
        return step_table(judged, device)
    compute = lambda: p.twin.step_logits([(steps[k].prefix, steps[k].tree, need) for k, need in asks])
    tables, twins = alongside(compute, lambda: step_table(judged, device), device)
    return with_twins(tables, judged, asks, twins, device)


def twin_asks(rule, judged: list[RequestRows], device) -> Asks:
    """The nodes of each request whose verdict the twin can change (a request that carries every node's twin
    asks for none)."""
    wanting = [k for k, j in enumerate(judged) if j.twin is None]
    errors = node_errors([judged[k] for k in wanting], device) if wanting else []
    asks = [(k, [i for i, (e, rounded) in enumerate(errs) if rule.needs_twin(e, rounded)])
            for k, errs in zip(wanting, errors)]
    return [(k, need) for k, need in asks if need]


def alongside(background: Callable, foreground: Callable, device) -> tuple:
    """(foreground(), background()): on the CPU with two of torch's threads or more, background runs on a thread
    of its own while foreground runs here (each on one of torch's threads: the intra-op pool is process-wide);
    elsewhere background first, then foreground. An exception of either is raised once both have ended (the
    foreground's first)."""
    threads = torch.get_num_threads()
    if threads < 2 or torch.device(device).type != "cpu":
        later = background()
        return foreground(), later
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="twin") as pool:
            running = pool.submit(background)
            try:
                here = foreground()
            except BaseException:
                running.exception()   # waits for the background's end: nothing runs on past this call
                raise
            return here, running.result()
    finally:
        torch.set_num_threads(threads)


def with_twins(tables: list[list[RowResult]], judged: list[RequestRows], asks: Asks, twins: list[torch.Tensor],
               device) -> list[list[RowResult]]:
    """The asked nodes' rows with their twin's quantities. twins: per ask, [len(need), vocab] in need's order."""
    tables = list(tables)
    for (k, need), twin in zip(asks, twins):
        idx, j = torch.tensor(need), judged[k]
        cols = twin_table(j.engine[idx.to(j.engine.device)], j.ref[idx], twin, device)
        rows = tables[k] = list(tables[k])
        for i, (err, dist, l2) in zip(need, cols):
            rows[i] = replace(rows[i], twin_err=err, twin_dist=dist, l2=(rows[i].l2[0], l2, rows[i].l2[2]))
    return tables
