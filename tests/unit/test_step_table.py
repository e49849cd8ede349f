"""compare/step_table.py: a step's rows compared on the device with one host copy give exactly the numbers of
the per-node path it replaced (compare_rows per request on the oracle's device, one isfinite per padding row,
the twin's and rounded computation's errors, twin_dist and rel_l2 each a call of their own)."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from harness.check.compare.metrics import compare_rows, engine_block, rel_l2
from harness.check.compare.step_table import ROWS_PER_PASS, RequestRows, step_table, twin_table
from harness.check.prepare import prepare
from harness.engine.settings import RunSettings


def per_node(r: RequestRows) -> list[tuple]:
    """The per-node path as differential.py had it before step_table: one tuple per verify row."""
    real = r.ref.shape[0]
    metrics = compare_rows(r.engine[:real], r.ref[:real])
    out = []
    if r.twin is not None:
        twin_errs = [m.rel_err for m in compare_rows(r.twin[:real], r.ref[:real])]
        rounded_errs = [m.rel_err for m in compare_rows(r.rounded[:real], r.ref[:real])]
        scale = r.ref[:real].abs().amax(-1).clamp_min(1e-30)
        dists = ((r.engine[:real].double() - r.twin[:real].double()).abs().amax(-1) / scale).tolist()
        l2s = list(zip(*(rel_l2(x[:real], r.ref[:real]) for x in (r.engine, r.twin, r.rounded))))
    for row in range(r.engine.shape[0]):
        if row >= real:
            out.append(("padding", bool(torch.isfinite(r.engine[row]).all())))
        elif r.twin is None:
            out.append((metrics[row], None, None, None, (None, None, None)))
        else:
            out.append((metrics[row], twin_errs[row], rounded_errs[row], dists[row], l2s[row]))
    return out


def tabled(rows) -> list[tuple]:
    return [("padding", x.finite) if x.metrics is None else (x.metrics, x.twin_err, x.rounded_err, x.twin_dist, x.l2)
            for x in rows]


def same(a: list[tuple], b: list[tuple]) -> bool:
    """Equal, NaN equal to NaN (a NaN gap of an all-NaN oracle row stays NaN on both paths)."""
    def key(x):
        return repr(x)
    return [key(x) for x in a] == [key(x) for x in b]


@pytest.fixture(scope="module")
def tiny_steps():
    """The first three verify steps of a tiny-preset bf16 run of 2 requests with padding rows, with the oracle's
    rows, the twins and the rounded computations, as the check computes them."""
    from harness.check.differential import _judge_request_step
    p = replace(prepare(RunSettings(budget=16, topk=1, batch=2, max_new_tokens=16, backend="torch", dtype="bfloat16")),
                every_twin=True)
    out = []
    for result in itertools.islice(p.engine.rounds(), 3):
        out.append([_judge_request_step(rs, p) for rs in result.requests])
    return out


def test_a_tiny_run_step_equals_the_per_node_path(tiny_steps):
    padded = 0
    for step in tiny_steps:
        got = step_table(step)
        assert len(got) == len(step)
        for r, rows in zip(step, got):
            assert r.twin is not None   # the noise-floor verdict's quantities too
            padded += r.engine.shape[0] > r.ref.shape[0]
            assert same(tabled(rows), per_node(r))
    assert padded   # padding rows among them


def test_without_a_twin_and_with_broken_rows(tiny_steps):
    """Fixed-tolerance rows (no twin), a non-finite engine row, a non-finite padding row, a block of the wrong
    shape (engine_block's NaN rows): still the per-node path's numbers."""
    r = tiny_steps[0][0]
    engine = r.engine.clone()
    engine[1, 3] = float("nan")
    engine[-1, 0] = float("inf")
    short, _ = engine_block(r.engine[:2], r.engine.shape[0], r.engine.shape[1])   # rows 2.. are NaN
    cases = [RequestRows(engine, r.ref), RequestRows(short, r.ref), RequestRows(engine, r.ref, r.twin, r.rounded)]
    for case, rows in zip(cases, step_table(cases)):
        assert same(tabled(rows), per_node(case))
    verdicts = [m.metrics.finite for m in step_table(cases[:1])[0][:r.ref.shape[0]]]
    assert verdicts[1] is False and step_table(cases[:1])[0][-1].finite is False


def test_an_empty_step():
    assert step_table([]) == []


def test_the_yardsticks_are_judged_by_rel_err_alone(tiny_steps, monkeypatch):
    """The twin's and the rounded computation's rows give rel_err only: one pair of log-softmaxes per request
    (the engine's KL against the oracle), none for the yardsticks (0.5 s of a 4.1 s oracle step of a 135M model at
    budget 32, topk 4, batch 4 on one CPU thread went to softmaxes whose columns were thrown away)."""
    calls = []
    log_softmax = torch.log_softmax
    monkeypatch.setattr(torch, "log_softmax", lambda *a, **k: calls.append(1) or log_softmax(*a, **k))
    step = tiny_steps[0]
    assert all(r.twin is not None for r in step)
    tabled(itertools.chain.from_iterable(step_table(step, "cpu")))
    assert len(calls) == 2 * sum(-(-r.ref.shape[0] // ROWS_PER_PASS) for r in step)   # per pass of rows


def test_without_the_twin_its_columns_are_none_and_twin_table_gives_them(tiny_steps):
    """The check computes the twin beside the table, for some nodes (check/twin_step.py): the table
    without it has the rounded yardstick's numbers and None for the twin's, and twin_table gives the per-node
    path's twin numbers for any rows asked, in the order asked."""
    r = tiny_steps[1][0]
    rows = step_table([replace(r, twin=None)])[0]
    want = per_node(r)
    real = r.ref.shape[0]
    for row, (m, twin_err, rounded_err, dist, l2) in zip(rows[:real], want):
        assert repr((row.metrics, row.rounded_err, row.l2[0], row.l2[2])) == repr((m, rounded_err, l2[0], l2[2]))
        assert row.twin_err is None and row.twin_dist is None and row.l2[1] is None
    some = [real - 1, 0, 2]
    got = twin_table(r.engine[some], r.ref[some], r.twin[some], "cpu")
    assert got == [(want[i][1], want[i][3], want[i][4][1]) for i in some]
    assert twin_table(r.engine[:0], r.ref[:0], r.twin[:0], "cpu") == []


def test_rows_past_one_pass_give_the_same_numbers(tiny_steps, monkeypatch):
    """More rows than ROWS_PER_PASS: taken in passes, every row's numbers those of the per-node path."""
    import harness.check.compare.step_table as st
    monkeypatch.setattr(st, "ROWS_PER_PASS", 3)
    for r in tiny_steps[0]:
        assert r.ref.shape[0] > 3
        assert same(tabled(step_table([r])[0]), per_node(r))
