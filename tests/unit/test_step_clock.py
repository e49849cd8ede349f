"""check/step_clock.py: step 0 (compilation, capture, prefill) is timed apart; the per-step figures and the
oracle/engine ratio are of the steps after it. Time is a fake clock here: nothing depends on the machine."""
from __future__ import annotations

import pytest

import harness.check.step_clock as step_clock
from harness.check.step_clock import StepClock


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def fake(monkeypatch):
    t = FakeTime()
    monkeypatch.setattr(step_clock.time, "perf_counter", t.perf_counter)
    return t


def _run(fake: FakeTime, engine_costs: list[float], oracle_costs: list[float]) -> StepClock:
    clock = StepClock()

    def rounds():
        for i, cost in enumerate(engine_costs):
            fake.now += cost
            yield i
    for step in clock.timed(rounds()):
        with clock.oracle():
            fake.now += oracle_costs[step]
    return clock


def test_step_zero_is_the_warm_up(fake):
    clock = _run(fake, [10.0, 1.0, 1.0, 1.0], [20.0, 3.0, 3.0, 3.0])
    assert (clock.engine_warmup_s, clock.oracle_warmup_s) == (10.0, 20.0)
    assert clock.per_step() == (1.0, 3.0) and clock.per_step(4) == (1.0, 3.0)
    assert clock.ratio() == 3.0


def test_one_step_has_only_a_warm_up(fake):
    clock = _run(fake, [5.0], [7.0])
    assert (clock.engine_warmup_s, clock.oracle_warmup_s) == (5.0, 7.0)
    assert clock.per_step() == (None, None) and clock.ratio() is None


def test_no_step(fake):
    clock = _run(fake, [], [])
    assert clock.per_step() == (None, None) and clock.ratio() is None and clock.engine_warmup_s == 0.0
