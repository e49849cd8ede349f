"""The bug that started ddcheck, replayed on SGLang's kernel: with budget 16
and topk 1, a chain of 8 real rows is padded to q_len 17, and real nodes that
can see the padded KV slots go wrong. The engineer's three restarts become
three assertions: no padding, no bug; padding, bug; graphs off, still the bug."""
import json

import pytest

from harness.engine.attn.sglang_triton import available
from harness.check.differential import check
from harness.check.prepare import prepare
from harness.faults import why_cannot_show
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings

pytestmark = pytest.mark.skipif(not available(), reason="SGLang's kernel does not import")
SEED = dict(topk=1, backend="sglang-triton", batch=2, max_new_tokens=6)  # code-like next to poem-like


def _run(**kw):
    writer = RecordWriter(None)
    summary = check(prepare(RunSettings(**{**SEED, **kw})), writer)
    return summary, [json.loads(line) for line in writer.lines]


def test_budget_7_is_a_chain_without_padding_so_the_fault_cannot_show():
    """budget 7, topk 1: 7 drafts fill q_len 8 exactly; no padding row, nothing to leak."""
    assert why_cannot_show("padded-kv-visible", RunSettings(**{**SEED, "budget": 7}), 128) is not None
    summary, records = _run(budget=7)
    assert summary.passed and summary.padding_rows == 0


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_budget_16_leaks_padding_with_and_without_graphs(cuda_graph):
    """budget 16, topk 1: 8 real rows in q_len 17; the leak shows on both prompts, graphs or not,
    and the localizer names padding columns as what the real rows saw."""
    summary, records = _run(budget=16, cuda_graph=cuda_graph, fault="padded-kv-visible")
    assert not summary.passed and summary.first.step == 0 and summary.first.padding_present
    diverged = {r["request"] for r in records if r["kind"] == "node" and r["verdict"] == "diverge"}
    assert diverged == {0, 1}  # the code-like and the poem-like prompt alike
    loc = next(r for r in records if r["kind"] == "localize")
    assert loc["fault_class"] == "padding-leak"
    probe = loc["mask_probe"]
    assert probe["leaked"] and not probe["blocked"]
    assert all(probe["key_roles"][col].startswith("padding") for _, col in probe["leaked"])
    assert all(row < 8 for row, _ in probe["leaked"])  # only the 8 real rows leak


def test_budget_16_without_the_fault_matches_the_oracle():
    """The same setting with the padding masked matches the float64 oracle node for node."""
    summary, records = _run(budget=16)
    assert summary.passed and summary.padding_rows > 0 and summary.nodes_checked > 0
