"""A run whose oracle judges each step in one pass (prepare_step) writes the
records a run whose oracle answers request by request writes: the same
verdicts, and the same figures to the last bits a float64 sum can move."""
from __future__ import annotations

import json
from dataclasses import replace

from harness.check.differential import check
from harness.check.prepare import prepare
from harness.check.records import RecordWriter, same_run_to_run
from harness.engine.settings import RunSettings

SETTING = dict(backend="torch", model="tiny", dtype="bfloat16", budget=8, topk=2, batch=2, max_new_tokens=6)


class PerCall:
    """The oracle's protocol without its optional prepare_step."""

    def __init__(self, oracle) -> None:
        self._oracle = oracle

    def __getattr__(self, name):
        if name == "prepare_step":
            raise AttributeError(name)
        return getattr(self._oracle, name)


def rounded(value):
    if isinstance(value, float):
        return float(f"{value:.9g}")
    if isinstance(value, list):
        return [rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return value


def records(per_call: bool):
    p = prepare(RunSettings(**SETTING))
    calls = []
    if per_call:
        p = replace(p, loaded=replace(p.loaded, oracle=PerCall(p.oracle)))
    else:
        prepare_step = p.oracle.prepare_step
        p.oracle.prepare_step = lambda trees, low=(): calls.append((len(trees), list(low))) or prepare_step(trees, low)
    writer = RecordWriter(None)
    summary = check(p, writer, localize=False)
    lines = [rounded(same_run_to_run(json.loads(ln))) for ln in writer.lines]
    return summary, [ln for ln in lines if ln.get("kind") != "summary"], calls


def test_a_step_judged_in_one_pass_writes_the_per_request_records():
    packed, packed_lines, calls = records(per_call=False)
    plain, plain_lines, _ = records(per_call=True)
    assert packed.passed and plain.passed and packed.steps == plain.steps > 1
    assert len(calls) == packed.steps and calls[0] == (2, [("bfloat16", False)])   # each step, whole
    assert packed_lines == plain_lines
