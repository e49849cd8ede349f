"""The issue's matrix, engine against oracle: budget {4, 8, 16, 32} x topk
{1, 2, 4} x graph {on, off} x batch {1, 4} with the torch backend. Every
fault-free setting passes; padded-kv-visible is caught wherever it can show.
Plus the seed's exact command line, with and without the fault."""
from __future__ import annotations

import itertools
import json
import re

import pytest
from typer.testing import CliRunner

from harness.check.differential import check

from harness.check.prepare import prepare
from harness.faults import why_cannot_show
from harness.engine.model.presets import PRESETS
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings

MAX_NEW_TOKENS = 12  # several verify rounds per request; the whole matrix stays near a minute on 2 cores
FAULT = "padded-kv-visible"
MATRIX = [dict(budget=b, topk=k, cuda_graph=g, batch=bs)
          for b, k, g, bs in itertools.product((4, 8, 16, 32), (1, 2, 4), (True, False), (1, 4))]


def setting_id(m: dict) -> str:
    return f"b{m['budget']}-k{m['topk']}-{'graph' if m['cuda_graph'] else 'eager'}-bs{m['batch']}"


def run_check(fault: str | None = None, **m):
    s = RunSettings(**m, backend="torch", max_new_tokens=MAX_NEW_TOKENS, fault=fault)
    return check(prepare(s), RecordWriter(None))


@pytest.mark.slow
@pytest.mark.parametrize("m", MATRIX, ids=setting_id)
def test_fault_free_setting_passes(m):
    """Every node matches the oracle and every emitted stream its greedy continuation."""
    summary = run_check(**m)
    assert summary.passed, (summary.first, summary.notes)
    assert summary.nodes_checked > 0 and summary.divergent_nodes == 0 and summary.stream_mismatches == 0
    assert summary.first is None


SHOWS = [m for m in MATRIX if why_cannot_show(FAULT, RunSettings(**m, backend="torch",
                                                                    max_new_tokens=MAX_NEW_TOKENS),
                                              PRESETS["tiny"].vocab_size) is None]


def test_fault_can_show_exactly_where_padding_exists():
    """padded-kv-visible needs padding rows: actual < budget, i.e. topk 1 with budget > L = 7 here."""
    assert {(m["budget"], m["topk"]) for m in SHOWS} == {(8, 1), (16, 1), (32, 1)}


@pytest.mark.slow
@pytest.mark.parametrize("m", SHOWS, ids=setting_id)
def test_padded_kv_visible_is_caught(m):
    """Where padding rows exist, the leak diverges and the first divergent node is named."""
    summary = run_check(FAULT, **m)
    assert not summary.passed and summary.divergent_nodes > 0
    first = summary.first
    assert first is not None and first.what == "node"
    assert first.step >= 0 and 0 <= first.request < m["batch"] and first.depth is not None
    assert first.padding_present


@pytest.fixture(scope="module")
def cli():
    from harness.cli import _register, app
    _register()
    return app


SEED_ARGS = ["run", "--budget", "16", "--topk", "1", "--no-cuda-graph", "--backend", "torch"]


def test_seed_command_passes_without_the_fault(cli, tmp_path):
    """`ddcheck run --budget 16 --topk 1 --no-cuda-graph --backend torch` exits 0 and writes its records."""
    out = tmp_path / "seed.jsonl"
    result = CliRunner().invoke(cli, SEED_ARGS + ["--out", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "PASS" in result.stdout
    summary = json.loads(out.read_text().splitlines()[-1])
    assert summary["kind"] == "summary" and summary["passed"] is True


def test_seed_command_with_the_fault_names_the_first_divergent_node(cli, tmp_path):
    """The seed's bug switched on: exit 1 and the summary names step, request, node and depth."""
    out = tmp_path / "seed-fault.jsonl"
    result = CliRunner().invoke(cli, SEED_ARGS + ["--fault", FAULT, "--out", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.output
    assert "DIVERGE" in result.stdout
    assert re.search(r"first divergence\s*│\s*step \d+, request \d+, node \d+ \(depth \d+\)", result.stdout), result.stdout
    assert "padding rows present" in result.stdout
    summary = json.loads(out.read_text().splitlines()[-1])
    assert summary["passed"] is False and summary["first"]["node"] is not None
