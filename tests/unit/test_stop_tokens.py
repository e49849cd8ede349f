"""Stop tokens (--eos-id): the oracle's greedy stream ends at its first eos,
the engine ends a request's acceptance at an accepted eos (the eos becomes the
bonus, nothing past it is committed) and retires the request after it."""
from __future__ import annotations

import json
from dataclasses import replace

from harness.check.differential import check, cut_stream

from harness.check.prepare import prepare
from harness.engine.ddtree.accept import Acceptance, cut_at_stop
from harness.engine.ddtree.tree import DraftTree
from harness.workflows.fault_selftest import base_settings, stop_token
from harness.check.records import RecordWriter

CHAIN = DraftTree((5, 6, 7, 8), (None, 0, 1, 2), (0, 1, 2, 3), q_len=5)


def test_acceptance_ends_at_an_accepted_eos_which_becomes_the_bonus():
    acc = Acceptance((0, 1, 2, 3), 9)
    assert cut_at_stop(CHAIN, acc, 7) == Acceptance((0, 1), 7)   # row 2 (token 7) is the eos: rows 2, 3 dropped
    assert cut_at_stop(CHAIN, acc, 5) == acc                      # the root is the last round's bonus, not a draft
    assert cut_at_stop(CHAIN, acc, 9) == acc and cut_at_stop(CHAIN, acc, None) == acc
    assert cut_stream([3, 7, 4, 7], 7) == [3, 7] and cut_stream([3, 4], 7) == [3, 4]


def test_a_run_with_an_eos_stops_there_on_both_sides_and_passes():
    s = replace(base_settings("torch", quick=True), batch=2)
    s = replace(s, eos_id=stop_token(s))
    p = prepare(s)
    writer = RecordWriter(None)
    summary = check(p, writer)
    assert summary.passed, summary.explanation
    first = p.engine.requests[0].emitted
    assert first[-1] == s.eos_id and s.eos_id not in first[:-1] and len(first) < s.max_new_tokens
    streams = [json.loads(line) for line in writer.lines if '"kind": "stream"' in line]
    assert streams[0]["reference_tokens"][-1] == s.eos_id and streams[0]["verdict"] == "match"
