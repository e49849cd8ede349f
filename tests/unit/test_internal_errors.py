"""Internal errors of ddcheck that mutants of the engine found (issue 21,
point 7; benchmarks/mutation_engine.py): each was an exception in ddcheck's
own code (exit 3, "could not judge") where the engine under test was wrong,
and is now a verdict."""
from __future__ import annotations

from dataclasses import replace

from harness.check.compare.metrics import engine_block
from harness.check.differential import check
from harness.check.prepare import prepare
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings

import torch

SETTING = dict(backend="torch", budget=8, topk=2, max_new_tokens=6, stop_after=1)


def _engine_with_logits_blocks(cut):
    """The engine under test, its every request handed CUT(logits) as its logits block (a wrong slice
    of the batch's logits in the loop, as the mutant `logits[b * q:(b - 1) * q]` makes)."""
    p = prepare(RunSettings(**SETTING))
    rounds = p.engine.rounds

    def cut_rounds():
        for result in rounds():
            yield replace(result, requests=tuple(replace(rs, logits=cut(rs.logits)) for rs in result.requests))
    p.engine.rounds = cut_rounds
    return p


def test_an_empty_logits_block_is_a_divergence_not_an_internal_error():
    p = _engine_with_logits_blocks(lambda x: x[:0])
    summary = check(p, RecordWriter(None))
    assert summary.verdict == "diverge", summary.crash
    assert summary.crash is None
    assert summary.first.what == "node" and summary.first.step == 0 and summary.first.node == 0
    assert any("logits block of shape [0, " in n for n in summary.notes), summary.notes


def test_a_short_logits_block_keeps_the_rows_it_has():
    p = _engine_with_logits_blocks(lambda x: x[:2])
    summary = check(p, RecordWriter(None))
    assert summary.verdict == "diverge" and summary.crash is None
    # rows 0 and 1 are the engine's own, and right; row 2 is missing
    assert summary.first.what == "node" and summary.first.node == 2


def test_engine_block_shapes():
    x = torch.randn(3, 5)
    same, why = engine_block(x, 3, 5)
    assert same is x and why is None
    short, why = engine_block(x[:1], 3, 5)
    assert torch.equal(short[0], x[0]) and short[1:].isnan().all() and "[1, 5]" in why
    long, why = engine_block(torch.randn(4, 5), 3, 5)
    assert long.shape == (3, 5) and long.isnan().all() and why
    other_vocab, why = engine_block(torch.randn(3, 6), 3, 5)
    assert other_vocab.shape == (3, 5) and other_vocab.isnan().all() and why
