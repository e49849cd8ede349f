"""check/twin_step.py: which nodes need their twin is read from the table's own two numbers, and the twins'
forward runs beside the table on the CPU (one thread each) with the same rows as one after the other."""
from __future__ import annotations

import threading

import pytest
import torch

from harness.check.compare.step_table import ROWS_PER_PASS, RequestRows, node_errors, step_table
from harness.check.twin_step import alongside


def _rows(real: int, q_len: int, seed: int) -> RequestRows:
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(real, 50, generator=g, dtype=torch.float64)                          # [real, vocab]
    engine = (ref + 0.01 * torch.randn(real, 50, generator=g, dtype=torch.float64)).to(torch.bfloat16)
    padding = torch.randn(q_len - real, 50, generator=g).to(torch.bfloat16)
    rounded = ref + 0.005 * torch.randn(real, 50, generator=g, dtype=torch.float64)
    return RequestRows(torch.cat([engine, padding]), ref, None, rounded)


def test_node_errors_are_the_tables_own_numbers():
    step = [_rows(ROWS_PER_PASS + 5, ROWS_PER_PASS + 9, 0), _rows(3, 17, 1)]   # a split pass; padding rows after
    errors = node_errors(step, "cpu")
    table = step_table(step, "cpu")
    assert [len(e) for e in errors] == [ROWS_PER_PASS + 5, 3]
    for errs, rows in zip(errors, table):
        assert errs == [(r.metrics.rel_err, r.rounded_err) for r in rows if r.metrics is not None]
    with pytest.raises(ValueError, match="rounded"):
        node_errors([RequestRows(step[0].engine, step[0].ref)], "cpu")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_twins_run_beside_the_table_one_thread_each_on_the_cpu(two_threads):
    started, seen = threading.Event(), []

    def twins():      # returns only once the table has started: one after the other, it would time out
        seen.append(("twins", torch.get_num_threads()))
        return started.wait(timeout=30)

    def table():
        seen.append(("table", torch.get_num_threads()))
        started.set()
        return "table"

    assert alongside(twins, table, "cpu") == ("table", True)
    assert sorted(seen) == [("table", 1), ("twins", 1)] and torch.get_num_threads() == 2
    order = []
    torch.set_num_threads(1)      # one thread: the twins first, then the table
    assert alongside(lambda: order.append("twins") or 1, lambda: order.append("table") or 2, "cpu") == (2, 1)
    assert order == ["twins", "table"]


def test_an_exception_on_either_side_is_raised_after_both_end(two_threads):
    ended = threading.Event()

    def slow_twins():
        ended.wait(timeout=0.2)
        ended.set()
        return 1

    with pytest.raises(ZeroDivisionError):
        alongside(slow_twins, lambda: 1 / 0, "cpu")
    assert ended.is_set() and torch.get_num_threads() == 2
    with pytest.raises(KeyError):
        alongside(lambda: {}["twin"], lambda: 2, "cpu")
    assert torch.get_num_threads() == 2
